"""Multi-process layouts: expert parallelism (EP) and data-parallel attention (DP) over torch.distributed.

- `layout`: the --ep/--dp/--cp rules and a rank's place in the layout;
- `launch`: one process per rank, device visibility, rendezvous, failure propagation;
- `groups`: each rank's EP and CP group (sub-groups of the world where a layout has several),
  made through the back end's `Collectives.new_group`, and collectives bound to one group;
- `expert_parallel`: experts sharded across the EP group, tokens exchanged by all-to-all through
  the back end's `Collectives`, and the lockstep that keeps idle ranks in every collective.
- `expert_placement`: physical expert slots per MoE layer (redundant experts), routing a token to
  a replica, and the load counters (used by the eplb feature).

See docs/parallelism.md.
"""
