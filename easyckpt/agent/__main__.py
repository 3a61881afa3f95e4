"""The agent's entry point: ``python -m easyckpt.agent '<config json>'``, started by the first local rank
(engine/link/client.py) or by ``easyckpt run``. Importing it loads neither torch nor an unpickler."""
from __future__ import annotations

import json
import sys
from typing import List

from easyckpt import console
from easyckpt.agent.agent import Agent
from easyckpt.config import Config
from easyckpt.errors import EasyCkptError


def main(argv: List[str]) -> int:
    cfg = Config.from_json(json.loads(argv[0]))
    console.install(0, speaker="easyckpt agent")   # its stderr is the agent log (storage/savedir.py)
    # training comes first: the threads that persist and replicate lower their own priority (priority.py)
    try:
        agent = Agent(cfg)
    except OSError as exc:
        print(f"easyckpt agent for job {cfg.job_id} not started: {exc} (another agent is running?)",
              file=sys.stderr)
        return 3
    except EasyCkptError as exc:
        print(f"easyckpt agent for job {cfg.job_id} not started: {exc}", file=sys.stderr)
        return 4
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
