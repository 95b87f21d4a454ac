"""HARTS trainer entry point: ``torchrun --nproc_per_node N train.py --config configs/X.toml [--section.key=value ...]``.

Single process: ``python train.py --config configs/X.toml``. See docs/training.md.
"""
import logging
import os
import sys


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s rank" + os.environ.get("RANK", "0")
                        + "] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if os.environ.get("RANK", "0") != "0":
        logging.getLogger().setLevel(logging.WARNING)
    from harts.train.config import parse_args
    from harts.train.trainer import Trainer

    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    if cfg.job.print_config and os.environ.get("RANK", "0") == "0":
        print(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # gloo + FSDP2 workers occasionally abort in interpreter teardown after destroy_process_group
        # (../shared/notes/cpu-env.md section 4); everything is written and closed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
