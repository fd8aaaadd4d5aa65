"""Every `python -m copytask ...` command that README.md and docs/ show runs as written: each is
taken from the page and checked as the command checks its input before it does any work (the
composed and validated grid of `train` and `sweep`, the options of `compare`, `report`, `analyze`,
`decode` and `bench`), without training anything. A command a page shows that its own command
line would refuse fails here, naming the page and line."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from copytask import cli, cli_decode
from copytask.bench import measures
from copytask.bench.command import parse as bench_parse
from copytask.config.checks import check_launcher, remote_job_check, remote_launcher, validate
from copytask.config.hydra_internals import override_args
from copytask.console import ConfigError
from copytask.sweeps.grid import check_grid, compose_grid

from .test_own_attention import OWN_EXAMPLE, write_own_example
from .test_own_model import write_own_model

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = "python -m copytask "
# Stand-ins a page writes for what the reader fills in.
PLACEHOLDERS = {"runs/<run folder>": "runs/some-run", "RUN_DIR": "runs/some-run", "SYMBOLS": "abc"}


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page:line, the command's arguments after `python -m copytask`) for every command in a code
    block (continued lines joined, comments dropped, the part after `&&` in a set-up line) and every
    one quoted inline (`python -m copytask ...`)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        in_block, number = False, 0
        while number < len(lines):
            line, where = lines[number], f"{page.name}:{number + 1}"
            number += 1
            if line.startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                while line.endswith("\\") and number < len(lines):
                    line, number = line[:-1] + " " + lines[number], number + 1
                for part in line.split("&&"):
                    part = part.strip()
                    if part.startswith(PREFIX):
                        found.append((where, part[len(PREFIX) :]))
            else:  # with arguments: a bare `python -m copytask decode` in a sentence names the command
                found += [
                    (where, quoted[len(PREFIX) :]) for quoted in re.findall(r"`(python -m copytask \w+ [^`]*)`", line)
                ]
    commands, seen = [], set()
    for where, text in found:
        for placeholder, value in PLACEHOLDERS.items():
            text = text.replace(placeholder, value)
        args = tuple(shlex.split(text, comments=True))
        if (
            "..." in text or "<" in text or args in seen
        ):  # a usage summary or a placeholder, not a command; or one checked already
            continue
        seen.add(args)
        commands.append((where, list(args)))
    return commands


COMMANDS = documented_commands()


def test_the_pages_show_commands_of_every_kind():
    kinds = {args[0] for _, args in COMMANDS}
    assert (
        kinds == set(cli.COMMANDS) - {"build"} and len(COMMANDS) > 50
    )  # build takes no arguments: the pages name it only in a sentence


class Checked(Exception):
    """The first job of a grid passed its check: enough, expanding a 135-run grid takes seconds."""


def check_first_job(overrides: list[str]) -> None:
    """`grid.check_grid`'s checks of a sweep, on its first job only: every override composes, the
    launcher can run here, and the first job's config is valid where it will run."""
    master, _ = compose_grid(overrides, expand_grid=False)
    launcher = master.hydra.launcher.get("_target_")
    check_launcher(launcher, master.hydra.runtime.choices.get("hydra/launcher"))
    job_check = remote_job_check if remote_launcher(launcher) else validate

    def first(config) -> None:
        job_check(config)
        raise Checked

    with pytest.raises(Checked):
        compose_grid(overrides, check=first)


@pytest.mark.slow
@pytest.mark.parametrize("where,args", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where, args, fake_slurm, tmp_path, monkeypatch):
    if any(name in " ".join(args) for name in OWN_EXAMPLE):  # run from a user's folder with the docs' examples
        monkeypatch.chdir(write_own_model(write_own_example(tmp_path)))
        monkeypatch.syspath_prepend(str(tmp_path))
    try:
        check_command(where, args)
    except ConfigError as error:
        if "pip install 'copytask[" in str(error) and not os.environ.get("CI"):  # CI installs every extra
            pytest.skip(f"{where} needs an extra this machine lacks: {error}")
        raise


def check_command(where: str, args: list[str]) -> None:
    command, rest = args[0], args[1:]
    if command == "train":
        overrides = override_args(rest)  # Hydra's own flags (--cfg job, --help) are Hydra's to answer
        check_grid(overrides, multirun=False) if len(overrides) == len(rest) else compose_grid(
            overrides, multirun=False
        )
    elif command == "sweep":
        check_first_job(override_args(rest))
    elif command in ("compare", "report", "analyze"):
        flags = [arg for arg in rest if arg.startswith("-")]
        assert set(flags) <= set(cli.COMMAND_FLAGS.get(command, ())), f"{where}: {command} has no option {flags}"
        compose_grid([arg for arg in rest if arg not in flags], expand_grid=False)
    elif command == "decode":
        cli_decode.parser().parse_args(rest)
    elif command == "bench":
        options = bench_parse(rest)
        measures.bench_config(measures.ATTENTIONS[0], options.lengths[0], options.overrides)
    else:
        pytest.fail(f"{where}: {command} is not a copytask command")


def test_bench_takes_overrides_after_a_list_option():
    """docs/bench.md's memory command: `train.threads=1` after `--memory-attentions a b` is an override,
    not a third attention."""
    options = bench_parse(["--lengths", "80", "--memory-attentions", "luong_general", "transformer", "train.threads=1"])
    assert options.memory_attentions == ["luong_general", "transformer"] and options.overrides == ["train.threads=1"]
    assert options.lengths == [80]


def heading_anchors(page: Path) -> set[str]:
    """The anchors a page's headings get, as GitHub makes them: lower case, punctuation dropped, spaces -> `-`."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_link_to_a_page_or_a_section_of_one_arrives():
    """A link to another page or to a section (`[text](page.md#section)`) names a page that exists and a heading
    it has: moving a section between pages, or renaming it, fails here naming the link."""
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s:]*\.md|)(?:#([^)\s]+))?\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file():
                broken.append(f"{page.name}: {target} does not exist")
            elif anchor and anchor not in heading_anchors(linked):
                broken.append(f"{page.name}: {target or page.name} has no section #{anchor}")
    assert not broken, "\n".join(broken)


# A page of measurements grows with every one taken: it keeps the current figures, each once, within its bound,
# and git keeps the history (`git log -p docs/<page>`).
LINE_BOUNDS = {"bench.md": 300}


@pytest.mark.parametrize("page, bound", LINE_BOUNDS.items())
def test_a_page_of_measurements_stays_within_its_bound(page, bound):
    lines = len((ROOT / "docs" / page).read_text().splitlines())
    assert lines <= bound, f"docs/{page} has {lines} lines, over its {bound}: history out, each figure once"
