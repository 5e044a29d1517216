"""The docs: the generated pages are what the code generates now (docs/configuration.md from the
config's metadata, the switch table in docs/platforms.md from mlxtoy.settings), every docs page
is linked from the README, every relative link and anchor resolves, and the README stays short."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from mlxtoy.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATOR = os.path.join(REPO, "scripts", "gen_docs.py")
README_MAX_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")


def check_docs(docs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, GENERATOR, "--check", "--docs", docs], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_generated_docs_are_current():
    r = check_docs(os.path.join(REPO, "docs"))
    assert r.returncode == 0, r.stderr + "\n(regenerate: .venv/bin/python scripts/gen_docs.py)"


def test_check_fails_on_a_stale_page(tmp_path):
    """Positive control: a page edited by hand (or a metadata change not regenerated) fails."""
    docs = tmp_path / "docs"
    shutil.copytree(os.path.join(REPO, "docs"), docs)
    page = docs / "configuration.md"
    page.write_text(page.read_text().replace("LoRA rank", "LoRA rank (edited by hand)", 1))
    r = check_docs(str(docs))
    assert r.returncode == 1 and "configuration.md" in r.stderr, r
    table = docs / "platforms.md"
    shutil.copy(os.path.join(REPO, "docs", "configuration.md"), page)  # current again
    table.write_text(table.read_text().replace("| `MLXTOY_KERNELS` |", "| `MLXTOY_KERNELZ` |", 1))  # in the table
    r = check_docs(str(docs))
    assert r.returncode == 1 and "platforms.md" in r.stderr and "configuration.md" not in r.stderr, r


def test_configuration_page_lists_every_option():
    text = open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8").read()
    squeezed = " ".join(text.split())
    for f in dataclasses.fields(TrainConfig):
        assert f"`--{f.name.replace('_', '-')}`" in text, f.name
        assert " ".join(f.metadata["help"].split()).replace("|", "\\|") in squeezed, f.name
    for flag in ("--config", "--resume", "--stop-at"):  # the job's own flags, from --help
        assert flag in text, flag


def unlinked_pages(readme: str, pages: list[str]) -> list[str]:
    """The pages (paths relative to the repository) that no Markdown link in `readme` names."""
    targets = {m.split("#", 1)[0] for m in LINK.findall(readme)}
    return [p for p in pages if p not in targets]


def test_every_docs_page_is_linked_from_the_readme():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    pages = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    assert len(pages) >= 8, pages
    assert not unlinked_pages(readme, pages + ["kernels/README.md"])
    # positive control: a README without the link to one page names that page
    assert unlinked_pages(readme.replace("](docs/export.md)", "]()"), pages) == ["docs/export.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # headings only, not comments in code
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def markdown_files() -> list[str]:
    return [os.path.join(REPO, "README.md"), os.path.join(REPO, "kernels", "README.md"),
            *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(path):
    """Every relative link names a file that exists, and an anchor that its headings give."""
    text = open(path, encoding="utf-8").read()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, broken


def test_slug_follows_github():
    assert slug("`MLXTOY_*` switches") == "mlxtoy_-switches"
    assert slug("Preference training (DPO, ORPO)") == "preference-training-dpo-orpo"
    assert slug("mlxtoy against mlx-lm, torch + peft") == "mlxtoy-against-mlx-lm-torch--peft"


def test_readme_is_a_five_minute_read():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    for script in ("scripts/quickstart.sh", "scripts/test.sh"):  # its quick-start commands
        assert script in "\n".join(lines) and os.access(os.path.join(REPO, script), os.X_OK), script
