"""Programmatic tool calling, measured: who on the team went over their travel budget?

The same question answered twice by a scripted "model" (a script standing in for an LLM, so the
run is deterministic and needs no API key):

1. Direct tool calls: the model calls get_team_members, then get_expenses once per member, and
   every tool output lands in its context, as in any tool-calling loop.
2. One program: the model calls code_interpreter once; its code calls the same two tools as host
   tools from the sandbox (`import host_tools`), adds up in the kernel, and prints only the
   answer. That printed answer is all the model reads.

Both must find the same members; the script prints the bytes that reach the model each way.

    .venv/bin/python examples/team_expenses.py                 # local sandbox (bubblewrap)
    .venv/bin/python examples/team_expenses.py --backend docker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.config import Settings
from orchestrator.host_tools import HostToolsSettings, ToolRegistry
from orchestrator.model_tool import ModelTool
from orchestrator.service import Service

# --- the data and the two tools (what a real host would fetch from its expense system) ---------

_NAMES = [
    "Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
    "Donald Knuth", "Frances Allen", "John McCarthy", "Margaret Hamilton", "Ken Thompson",
    "Radia Perlman", "Dennis Ritchie", "Shafi Goldwasser", "Leslie Lamport", "Karen Jones",
    "Tony Hoare", "Sophie Wilson", "Niklaus Wirth", "Adele Goldberg", "Butler Lampson",
]  # fmt: skip
_CATEGORIES = ["flight", "hotel", "train", "taxi", "meals", "conference", "car rental"]
_MERCHANTS = ["SkyWays", "InnCo", "RailNet", "CityCab", "Bistro 9", "DevConf", "RentIt"]


def _team() -> list[dict[str, Any]]:
    rng = random.Random(7)
    return [
        {
            "id": f"m{i + 1:02d}",
            "name": name,
            "email": f"{name.split()[0].lower()}@example.com",
            "role": rng.choice(["engineer", "designer", "manager", "researcher"]),
            "budget": rng.choice([12000, 14000, 16000]),
        }
        for i, name in enumerate(_NAMES)
    ]


def _expenses(member_id: str) -> list[dict[str, Any]]:
    rng = random.Random(member_id)
    start = date(2026, 7, 1)
    records = []
    for n in range(rng.randint(60, 140)):
        k = rng.randrange(len(_CATEGORIES))
        records.append(
            {
                "id": f"{member_id}-{n + 1:04d}",
                "date": (start + timedelta(days=rng.randrange(92))).isoformat(),
                "category": _CATEGORIES[k],
                "merchant": _MERCHANTS[k],
                "amount": round(rng.uniform(15, 260), 2),
                "currency": "EUR",
                "status": rng.choices(["approved", "pending", "rejected"], [8, 1, 1])[0],
                "note": f"{_CATEGORIES[k]} for the Q3 customer visits",
            }
        )
    return records


def get_team_members() -> list[dict[str, Any]]:
    """List the members of the team, each with an id, a name and a quarterly travel budget in
    EUR."""
    return _team()


async def get_expenses(member_id: str) -> list[dict[str, Any]]:
    """All expense records of one team member this quarter (Q3 2026).

    Args:
        member_id: The member's id, from get_team_members.

    Returns:
        Records with date, category, merchant, amount (EUR) and status; only `approved` ones
        count against the budget.
    """
    await asyncio.sleep(0.05)  # a real backend takes a while to answer
    return _expenses(member_id)


# --- a minimal tool-calling loop, and a scripted model --------------------------------------------


@dataclass
class Transcript:
    """What reaches the model: every tool output it reads (and the calls it wrote)."""

    calls: int = 0
    written: int = 0  # bytes of tool-call arguments the model produced
    read: int = 0  # bytes of tool outputs put into its context
    log: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.written + self.read


# A scripted model yields lists of (tool name, arguments) and is sent back the outputs as text.
Model = Generator[list[tuple[str, dict[str, Any]]], list[str], list[str]]
ToolFn = Callable[[dict[str, Any]], Any]


async def run_agent(model: Model, tools: dict[str, ToolFn]) -> tuple[list[str], Transcript]:
    transcript = Transcript()
    try:
        calls = next(model)
        while True:
            outputs = []
            for name, arguments in calls:  # a framework would run parallel calls at once
                transcript.calls += 1
                transcript.written += len(json.dumps(arguments).encode())
                text = await tools[name](arguments)
                transcript.read += len(text.encode())
                outputs.append(text)
            calls = model.send(outputs)
    except StopIteration as done:
        return done.value, transcript


def direct_model() -> Model:
    """Calls the tools one by one, as a model without a sandbox would, and reads everything."""
    (team_text,) = yield [("get_team_members", {})]
    team = json.loads(team_text)
    outputs = yield [("get_expenses", {"member_id": m["id"]}) for m in team]
    over = []
    for member, text in zip(team, outputs, strict=True):
        spent = sum(e["amount"] for e in json.loads(text) if e["status"] == "approved")
        if spent > member["budget"]:
            over.append(f"{member['name']}: spent {spent:.2f} of {member['budget']}")
    return over


PROGRAM = """\
import asyncio, host_tools
team = await host_tools.get_team_members()
records = await asyncio.gather(*[host_tools.get_expenses(m["id"]) for m in team])
for member, expenses in zip(team, records):
    spent = sum(e["amount"] for e in expenses if e["status"] == "approved")
    if spent > member["budget"]:
        print(f"{member['name']}: spent {spent:.2f} of {member['budget']}")
"""


def program_model() -> Model:
    """Writes one program that calls the tools in the sandbox and prints only the answer."""
    (output,) = yield [("code_interpreter", {"code": PROGRAM})]
    stdout = output.split("[stdout]\n", 1)[1].split("\n[", 1)[0] if "[stdout]" in output else ""
    return [line for line in stdout.splitlines() if line.strip()]


# --- the two runs ------------------------------------------------------------------------------


def _state_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="team-expenses-", dir="/tmp"))
    root.chmod(0o711)  # local sandboxes run as uids of their own: they pass through
    return root


async def main(backend: str) -> dict[str, Any]:
    registry = ToolRegistry([get_team_members, get_expenses])

    async def call_directly(name: str) -> ToolFn:
        tool = registry.get(name)

        async def run(arguments: dict[str, Any]) -> str:
            return json.dumps(await tool.call(arguments))  # what a tool-calling loop sends back

        return run

    direct_tools = {n: await call_directly(n) for n in registry.names}
    direct_answer, direct = await run_agent(direct_model(), direct_tools)

    root = _state_root()
    settings = Settings(
        auth_disabled=True,
        backends=[backend],
        default_backend=backend,
        state_dir=root / "state",
        host_tools=HostToolsSettings(session_default=registry.names),
    )
    service = Service(settings, registry)
    await service.start()
    try:
        session = await service.lifecycle.create(
            "example", CreateSessionRequest(backend=backend, tools=registry.names)
        )

        async def code_interpreter(arguments: dict[str, Any]) -> str:
            # The one tool flow: what POST /v1/tools/code_interpreter/invoke returns, too.
            outcome = await ModelTool(service).invoke("example", arguments["code"], session=session)
            return outcome.rendered.text

        program_answer, program = await run_agent(
            program_model(), {"code_interpreter": code_interpreter}
        )
    finally:
        await service.close()
        shutil.rmtree(root, ignore_errors=True)

    return {
        "backend": backend,
        "members": len(_team()),
        "records": sum(len(_expenses(m["id"])) for m in _team()),
        "direct": {"calls": direct.calls, "bytes_to_model": direct.total},
        "program": {"calls": program.calls, "bytes_to_model": program.total},
        "ratio": round(direct.total / program.total, 1),
        "same_answer": direct_answer == program_answer,
        "over_budget": program_answer,
        "direct_answer": direct_answer,
    }


def report(result: dict[str, Any]) -> None:
    d, p = result["direct"], result["program"]
    saved = 100 * (1 - p["bytes_to_model"] / d["bytes_to_model"])
    print(f"{result['members']} members, {result['records']} expense records")
    print(f"direct tool calls: {d['calls']:3d} calls, {d['bytes_to_model']:9,d} bytes to the model")
    print(f"one program:       {p['calls']:3d} call,  {p['bytes_to_model']:9,d} bytes to the model")
    print(f"{result['ratio']}x fewer bytes ({saved:.1f}% less context)")
    print("over budget:" + "".join(f"\n  {line}" for line in result["over_budget"]))
    print("both runs agree" if result["same_answer"] else "THE RUNS DISAGREE")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="local", choices=["local", "docker"])
    parser.add_argument("--json", action="store_true", help="Print the figures as JSON.")
    args = parser.parse_args()
    outcome = asyncio.run(main(args.backend))
    print(json.dumps(outcome, indent=1)) if args.json else report(outcome)
    sys.exit(0 if outcome["same_answer"] and outcome["over_budget"] else 1)
