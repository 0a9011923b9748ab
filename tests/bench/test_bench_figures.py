"""The benchmark's own logic: its summaries, the floor's kernel command lines, the language table.

Pure logic only; `make bench` itself measures (bench/), no test times anything.
"""

from __future__ import annotations

import pytest

from bench.interleave import Sampled
from bench.languages import bare_argv, shows_two
from bench.report import languages_section
from bench.stats import summarize, summarize_sampled
from sandbox.inside_kernel.kernel_supervisor import PLACEHOLDER
from sandbox.kernel.programs import KernelPrograms

pytestmark = pytest.mark.unit


def test_p95_of_few_samples_is_their_largest_never_below_the_median() -> None:
    stats = summarize([0.001, 0.002])
    assert stats["p95_ms"] == 2.0
    assert stats["p95_ms"] >= stats["median_ms"]
    assert summarize([i / 1000 for i in range(1, 201)])["p95_ms"] == 190.0


PROGRAMS = KernelPrograms(
    python="/k/bin/python",
    startup_file="/k/startup.py",
    supervisor="/k/supervisor.py",
    bash_kernel=True,
    deno="/k/bin/deno",
    java="/usr/bin/java",
    jjava_jar="/k/jjava.jar",
    r="/usr/bin/R",
)


def test_the_floor_starts_each_kernel_by_its_own_command_line_without_the_supervisor() -> None:
    assert bare_argv(PROGRAMS, "javascript") == [
        "/k/bin/deno",
        "jupyter",
        "--kernel",
        "--conn",
        PLACEHOLDER,
    ]
    assert bare_argv(PROGRAMS, "r") == [
        "/usr/bin/R",
        "--no-echo",
        "--no-restore",
        "-e",
        "IRkernel::main()",
        "--args",
        PLACEHOLDER,
    ]
    assert bare_argv(PROGRAMS, "bash") == ["/k/bin/python", "-m", "bash_kernel", "-f", PLACEHOLDER]
    java = bare_argv(PROGRAMS, "java")
    assert java[0] == "/usr/bin/java"
    assert java[-2:] == ["/k/jjava.jar", PLACEHOLDER]
    for argv in (java, bare_argv(PROGRAMS, "r"), bare_argv(PROGRAMS, "typescript")):
        assert "/k/supervisor.py" not in argv


def test_a_trivial_call_shows_two_in_each_language_s_own_form() -> None:
    assert shows_two("2")
    assert shows_two("2\n")  # bash's echo
    assert shows_two("[1] 2")  # R's print
    assert not shows_two("12")
    assert not shows_two("")


def _part(median_s: float, raw_median_ms: float) -> dict[str, object]:
    return {
        "stats": summarize_sampled(Sampled([median_s], [median_s * 2])),
        "samples": [median_s],
        "baseline_median_ms": raw_median_ms,
        "ratio": median_s * 1000 / raw_median_ms,
        "cpu_ratio": 1.5,
    }


def test_the_language_table_shows_each_row_with_its_ratio_and_says_what_was_not_run() -> None:
    figures = {
        "rows": [
            {
                "language": "r",
                "who": "local",
                "cold": _part(2.0, 1000.0),
                "round_trip": _part(0.01, 20.0),
            },
            {
                "language": "python",
                "who": "raw",
                "cold": _part(1.0, 1000.0),
                "round_trip": _part(0.004, 4.0),
            },
        ],
        "not_run": {"java (local)": "its kernel is not installed on this host"},
    }
    lines = languages_section(figures)
    rows = [line for line in lines if line.startswith("| python") or line.startswith("| r ")]
    assert rows[0].startswith("| python | raw | 1000.00 |")  # Python first, as LANGUAGES orders
    assert rows[1] == (
        "| r | local | 2000.00 | 2000.00 | 1 | 1000.00 | 2.00x | 1.50x "
        "| 10.00 | 10.00 | 1 | 20.00 | 0.50x | 1.50x |"
    )
    assert "- **java (local)**: not run: its kernel is not installed on this host." in lines
