from lockstep.cli import entry

entry()
