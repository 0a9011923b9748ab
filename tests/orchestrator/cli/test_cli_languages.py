"""`code-interpreter run` in other languages, run as a user runs it: `--language`, and the
language a script's suffix names."""

from __future__ import annotations

from pathlib import Path

from tests.orchestrator.cli.test_cli import run_cli


def test_run_a_shell_script_by_its_suffix(tmp_path: Path) -> None:
    script = tmp_path / "count.sh"
    script.write_text("for i in 1 2 3; do echo n$i; done\nWORD=done; echo $WORD\n")
    done = run_cli("run", "-f", str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "n1\nn2\nn3\ndone\n"


def test_run_an_r_script_by_its_suffix_and_an_r_error_fails(tmp_path: Path) -> None:
    script = tmp_path / "stats.R"
    script.write_text("x <- c(2, 4, 6)\ncat('mean', mean(x), '\\n')\n")
    done = run_cli("run", "-f", str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "mean 4"
    broken = tmp_path / "broken.r"
    broken.write_text("stop('no data')\n")
    failed = run_cli("run", "-f", str(broken))
    assert failed.returncode == 1 and "no data" in failed.stderr


def test_language_option_wins_over_the_suffix_and_takes_aliases(tmp_path: Path) -> None:
    script = tmp_path / "really-bash.txt"
    script.write_text("echo from-bash\n")
    done = run_cli("run", "--language", "sh", "-f", str(script))
    assert done.returncode == 0 and done.stdout == "from-bash\n", done.stderr
    inline = run_cli("run", "-l", "bash", "echo $((6 * 7))")
    assert inline.returncode == 0 and inline.stdout == "42\n", inline.stderr
    # A .sh script's suffix names Bash; the option wins: Python reads it, and fails.
    shell = tmp_path / "script.sh"
    shell.write_text("echo from-bash\n")
    python = run_cli("run", "-l", "python", "-f", str(shell))
    assert python.returncode == 1 and "SyntaxError" in python.stdout + python.stderr


def test_an_unknown_language_is_a_usage_error_naming_the_languages() -> None:
    done = run_cli("run", "--language", "cobol", "1")
    assert done.returncode == 2
    assert "'cobol'" in done.stderr and "python, bash" in done.stderr
