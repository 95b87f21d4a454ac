"""HARTS trainer entry point.

``torchrun --nproc_per_node N train.py --config configs/X.toml [--section.key=value ...]``.

Single process: ``python train.py --config configs/X.toml``. See docs/training.md.

Errors: rank 0 prints one line, ``error: <what, where (file:line or config key), what to change>``, and
every rank exits with status 1; other ranks stay quiet. ``HARTS_DEBUG=1`` prints the full traceback on
every rank instead.
"""
import logging
import os
import sys

# errors a user fixes in their config, data or output folder: one line, no traceback
USER_ERRORS = (ValueError, TypeError, OSError, FloatingPointError)


def _debug() -> bool:
    return os.environ.get("HARTS_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _report(e: BaseException, rank: int) -> None:
    """The one error line (rank 0 only)."""
    if rank != 0:
        return
    if isinstance(e, USER_ERRORS):
        msg = str(e) or type(e).__name__
    else:
        msg = f"{type(e).__name__}: {e} (HARTS_DEBUG=1 prints the traceback)"
    lines = msg.strip().splitlines() or [type(e).__name__]
    print("error: " + "\n  ".join(lines[:3]), file=sys.stderr, flush=True)


def _remove_if_empty(folder: str) -> None:
    """Removes ``folder`` if it holds no files (only empty folders): what a run that failed before writing
    anything leaves behind."""
    import shutil

    for _, _, files in os.walk(folder):
        if files:
            return
    shutil.rmtree(folder, ignore_errors=True)


def _single_process_group():
    """A one-process gloo group for ``python train.py`` (the checkpointer's collectives need one)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv=None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    from harts.env import cache_dirs, keep_host_memory

    cache_dirs()  # persistent Triton/inductor caches (~/.cache/harts) unless set: docs/first-gpu-run.md
    code, trainer, created = 0, None, None
    try:
        # pack's pages stay mapped (docs/runtime.md); a bad HARTS_HOST_MEMORY is a one-line error like the others
        logging.getLogger("harts.train").info(keep_host_memory())
        from harts.train.config import parse_args
        from harts.train.trainer import Trainer

        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        if rank == 0 and not os.path.exists(cfg.job.dump_folder):
            created = cfg.job.dump_folder  # removed again if the run fails before writing anything there
        if cfg.job.print_config and rank == 0:
            print(cfg)
        if "RANK" not in os.environ:
            _single_process_group()
        trainer = Trainer(cfg)
        trainer.train()
    except (Exception, SystemExit) as e:
        if isinstance(e, SystemExit) and (e.code is None or e.code == 0):
            return 0  # --help
        if _debug():
            raise
        if isinstance(e, SystemExit):  # tyro and argument errors have printed their message
            if not isinstance(e.code, int):
                _report(ValueError(str(e.code)), rank)
        else:
            _report(e, rank)
        code = 1
        if created:
            _remove_if_empty(created)
    finally:
        if trainer is not None and (code == 0 or world == 1):
            trainer.close()
        elif world == 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    if world > 1:
        # gloo + FSDP2 workers occasionally abort in interpreter teardown after destroy_process_group
        # (SIGABRT: "terminate called without an active exception"; os._exit avoids it), and after
        # an error the other ranks may sit in a collective; everything is written and closed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
