"""Measures llm-sandbox (run in its own virtualenv, see peers.py): session start and a trivial
run, in Docker with our kernel image and networking off. Prints the samples as JSON."""

import json
import sys
import time

from llm_sandbox import SandboxSession


def session() -> "SandboxSession":
    return SandboxSession(
        lang="python",
        image=sys.argv[1],
        skip_environment_setup=True,  # the image has Python already; nothing to install
        runtime_configs={"network_mode": "none", "user": "1000:1000"},
        workdir="/tmp/sandbox",
        verbose=False,
    )


def main() -> None:
    starts, runs = int(sys.argv[2]), int(sys.argv[3])
    start = []
    for _ in range(starts):
        t = time.perf_counter()
        with session():
            start.append(time.perf_counter() - t)
    execute = []
    with session() as s:
        for i in range(runs + 3):
            t = time.perf_counter()
            out = s.run("print(1+1)")
            if i >= 3:
                execute.append(time.perf_counter() - t)
            assert out.stdout.strip() == "2", out
        s.run("x = 1")
        stateful = s.run("print(x)").exit_code == 0
    print(json.dumps({"start": start, "execute": execute, "stateful": stateful}))


if __name__ == "__main__":
    main()
