"""The machinery behind `launch`, the warm pool and `%%ddp`, which a notebook never imports.

The faces a notebook uses stay at the top of the package (`launcher`, `pool`, `magic`,
`torchrun`); what they stand on lives here:

- `supervisor` starts a group of ranks, waits for their exits or their replies, and stops them;
  `output` prints what the ranks write, as `[rank N] ...` lines.
- `worker` is what runs inside each rank of `launch`; `serve` inside each rank of a warm pool,
  answering the requests of `protocol`. Both start and end a rank with `rank_setup`, in the
  environment `rank_env` makes; `cell_exec` runs a `%%ddp` cell there; `error_record` is what a rank
  that raised tells the kernel; `tutorial_ranks` a tutorial's own `init_process_group` in a rank;
  `c10d_names` what the c10d operators below torch.distributed are called.
- `cells` is what travels to the ranks and how their values come back; `rank_io` and
  `rank_backend` are a rank's side of rich output and input; `rank_views` the kernel's tabs.
- `forkserver` (and `forkserver_ready`) is the process every rank is forked from; `bytecode_cache`
  where it keeps compiled bytecode in a container; `private_net` the network of the ranks' own;
  `store_host` their rendezvous store; `run_dirs` the run folders.
- `processes`: whether a process is alive, and ending a process with everything it started.
- `rank_pdb` is a rank's pdb (breakpoints, post-mortem); `debug_session` the kernel's side of its prompt.
"""
import os

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The folder of ddp_helpers: frames of its code are plumbing in a rank's traceback."""
