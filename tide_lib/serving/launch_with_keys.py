"""Start an SGLang server with its keys from the environment, never on its command line.

SGLang 0.5.14 reads ``--api-key``/``--admin-api-key`` from argv, where ``ps`` shows
them, or from a ``--config`` YAML merged inside the server process. This wrapper
writes ``TIDE_SERVE__API_KEY`` and ``TIDE_SERVE__ADMIN_API_KEY`` into such a file
(mode 0600, path ``$TIDE_SGLANG_KEY_FILE``) and replaces itself with the server,
adding ``--config <file>``; an image uses it as its entrypoint::

    python3 -m tide_lib.serving.launch_with_keys python3 -m sglang.launch_server ...
"""

from __future__ import annotations

__all__ = ["main"]

import logging
import os
import sys
from pathlib import Path

from tide_lib.config import load_config
from tide_lib.serving.fleet import write_sglang_key_file

logger = logging.getLogger(__name__)
DEFAULT_KEY_FILE = "/run/tide/sglang-keys.yaml"


def main(argv: list[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        raise SystemExit(
            "usage: python -m tide_lib.serving.launch_with_keys COMMAND... "
            "(e.g. python3 -m sglang.launch_server --model-path ...)"
        )
    serve = load_config().serve
    if serve.api_key is None:
        raise SystemExit(
            "TIDE_SERVE__API_KEY is unset: an engine on the network needs SGLang's keys "
            "(set TIDE_SERVE__API_KEY and TIDE_SERVE__ADMIN_API_KEY)"
        )
    path = Path(os.environ.get("TIDE_SGLANG_KEY_FILE") or DEFAULT_KEY_FILE)
    write_sglang_key_file(path, api_key=serve.api_key, admin_api_key=serve.admin_api_key)
    logger.info("SGLang keys written to %s; starting %s", path, command[0])
    os.execvp(command[0], [*command, "--config", str(path)])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
