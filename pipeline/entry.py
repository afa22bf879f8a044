"""What every stage entry shares: logging configured once, params loaded, known errors as one clear line."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from pipeline.config import ConfigError, Params, StageError, load_params


def run_stage(name: str, main: Callable[[Params], object]) -> None:
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO"), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("alembic", "mlflow.store", "urllib3", "matplotlib", "PIL", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        main(load_params(os.environ.get("PARAMS_FILE", "params.yaml"), stage=name))
    except (ConfigError, StageError, FloatingPointError) as exc:
        print(f"\n{name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
