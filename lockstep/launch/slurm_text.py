"""The fixed texts of the sbatch script `lockstep slurm` renders (lockstep.launch.slurm): the trap that
turns the time limit's or a preemption's warning into a checkpoint and a requeue, and the note an
elastic job's script carries, with the Slurm facts each one rests on."""

# Facts seen on Slurm 22.05 (tests/e2e/test_slurm_cluster.py runs them): srun answers a SIGTERM of its own by
# SIGKILLing its tasks ("srun: forcing job termination"), so the trap signals the step through scancel, which
# without --batch / --full reaches the job's steps (torchrun and the workers) but not this shell. `scontrol
# requeue`, a preemption and the time limit itself SIGTERM every step and this shell, then SIGKILL after
# KillWait (30 s by default). A requeued job waits the credential lifetime (AuthInfo cred_expire, 120 s by
# default) before it may start again, then runs this script anew with SLURM_RESTART_COUNT set.
REQUEUE_TRAP = """\
# time limit or preemption: USR1 arrives {lead} s ahead; SIGTERM to the step reaches torchrun and the workers,
# which commit a checkpoint at the next step boundary and exit; the requeued job resumes from it
# (checkpoint.resume = auto). Not `kill $SRUN_PID`: srun would SIGKILL them before they commit.
lockstep_requeue() {{
  echo "lockstep: got USR1, stopping the workers and requeueing job $SLURM_JOB_ID"
  scancel --signal=TERM "$SLURM_JOB_ID"
  wait "$SRUN_PID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}}
trap lockstep_requeue USR1"""

# Seen on Slurm 22.05 with two nodes (test_elastic_job_trains_on_when_a_node_is_lost): nodeB's torchrun and
# worker killed -> nodeA's worker fails its collective at once ("Connection reset by peer"), srun keeps task 0,
# nodeA's torchrun restarts it, the rendezvous completes with nodeA alone, the worker resumes at world size 1;
# the job then ends FAILED with exit code 137, the code of the killed task.
ELASTIC_NOTE = """\
# elastic: {low} to {high} nodes. When a node's torchrun or workers die, the survivors' workers fail their next
# collective; srun (--no-kill --kill-on-bad-exit=0) leaves the other tasks running, each torchrun restarts its
# workers (--max-restarts {restarts}: each such re-forming counts), and the rendezvous completes without the lost
# node once its heartbeat has expired (3 missed beats 5 s apart) and last_call_timeout (30 s) has passed. The
# workers resume from the last committed checkpoint at the smaller world size, with the global batch of the
# plan below. A node that Slurm itself loses ends its task; --no-kill keeps the allocation and the step on the
# others. {store} The job's state then
# reflects the lost task (FAILED), not the run: the run's checkpoints/latest says how far training got."""


STORE_NOTE = {
    "node0": "The first node hosts the rendezvous store: without it the others cannot re-form.",
    "external": "The batch host serves the rendezvous store and runs no worker: any worker node "
    "may\n# be lost, the first one included.",
}
