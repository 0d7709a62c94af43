"""lockstep plan: memory, communication and step time per rank for a layout at any world size, from
the real model and parallel code on a fake process group
(docs/plan.md, "How a rank is simulated")."""
