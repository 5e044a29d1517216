"""Models and datasets named by their Hugging Face id, through `huggingface_hub` and its cache.

- `parse_id("org/name@rev")`, `parse_id("org/name/file.gguf")` -> HubRef, or None when the
  string is not shaped like an id (a path such as `./x`, `/x`, `~/x`, `x.jsonl`).
- `fetch_model(ref)`: the snapshot folder (safetensors, config and tokenizer files only), or the
  one named `.gguf` file, in the standard cache (`HF_HOME`, `HF_HUB_CACHE`).
- `fetch_dataset(ref, patterns)`: a dataset repo's snapshot folder (data files and its card).

`HF_HUB_OFFLINE=1` reads the cache only. Every hub failure (missing, private, gated, no such
revision or file, no network, offline and not cached) becomes one UserError line saying what to
do. Downloads show huggingface_hub's own progress bars on stderr.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from mlxtoy.errors import UserError

# what a model snapshot needs: weights, config and tokenizer files at the repo's top level
MODEL_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json"]
TOP_LEVEL_ONLY = ["*/*"]  # fnmatch's * crosses '/': keep other variants in subfolders out

# org/name: huggingface_hub's repo-id rule (letters, digits, - _ . ; no leading or trailing - .)
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?P<file>(?:/[^@]+)*/[^/@]+\.gguf)?(?:@(?P<rev>[^@\s]+))?$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None
    filename: str | None = None  # a file inside the repo (a .gguf)

    def __str__(self) -> str:
        return self.repo_id + (f"/{self.filename}" if self.filename else "") + \
            (f"@{self.revision}" if self.revision else "")


def parse_id(text: str) -> HubRef | None:
    """`org/name`, `org/name@revision`, `org/name/file.gguf[@revision]` -> HubRef; else None."""
    m = _ID.match(text.strip())
    if not m or "--" in m["repo"] or ".." in m["repo"]:
        return None
    file = m["file"][1:] if m["file"] else None
    return HubRef(m["repo"], m["rev"], file)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_location() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hub_error(e: Exception, ref: HubRef, kind: str) -> UserError:
    """One line for a huggingface_hub failure: what went wrong and what to do."""
    from huggingface_hub import errors as E

    page = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{ref.repo_id}"
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, E.GatedRepoError):
        msg = f"{ref.repo_id} is a gated {kind}: accept its terms at {page}, then {login}"
    elif isinstance(e, E.RepositoryNotFoundError):
        msg = f"no such local path, and no {kind} {ref.repo_id} on the Hugging Face Hub (private? {login})"
    elif isinstance(e, E.RevisionNotFoundError):
        msg = f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or commit)"
    elif isinstance(e, (E.LocalEntryNotFoundError, E.OfflineModeIsEnabled)):
        if offline():
            msg = (f"no such local path, and not in the Hugging Face cache ({cache_location()}) with "
                   f"HF_HUB_OFFLINE=1 set: download it once with the network on (unset HF_HUB_OFFLINE)")
        else:
            msg = (f"no such local path; the Hugging Face Hub cannot be reached and the cache "
                   f"({cache_location()}) does not hold it: check the network")
    elif isinstance(e, E.EntryNotFoundError):
        msg = f"{ref.repo_id} has no file {ref.filename!r}"
    elif isinstance(e, E.DisabledRepoError):
        msg = f"{ref.repo_id} is disabled on the Hugging Face Hub"
    else:
        msg = f"the Hugging Face Hub failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return UserError(f"{ref}: {msg}")


def _download(call, ref: HubRef, kind: str, **kw) -> str:
    """Run one huggingface_hub download; map its failures to UserError."""
    from huggingface_hub import errors as E

    try:
        return call(repo_id=ref.repo_id, revision=ref.revision, **kw)
    except (E.HfHubHTTPError, E.EntryNotFoundError, E.OfflineModeIsEnabled, E.HFValidationError) as e:
        raise hub_error(e, ref, kind) from None
    except OSError as e:  # network errors from the HTTP client, a full disk
        raise UserError(f"{ref}: cannot fetch from the Hugging Face Hub ({type(e).__name__}: {e})") from None


def _announce(ref: HubRef, kind: str) -> None:
    if not offline():
        print(f"mlxtoy: {kind} {ref}: checking the Hugging Face Hub (cache: {cache_location()})", file=sys.stderr)


def fetch_model(ref: HubRef) -> str:
    """The local path of a model repo's snapshot folder, or of its named .gguf file."""
    from huggingface_hub import hf_hub_download, snapshot_download

    _announce(ref, "model")
    if ref.filename:
        return _download(hf_hub_download, ref, "model", filename=ref.filename)
    return _download(snapshot_download, ref, "model", allow_patterns=MODEL_PATTERNS,
                     ignore_patterns=TOP_LEVEL_ONLY)


def fetch_dataset(ref: HubRef, patterns: list[str]) -> str:
    """The local snapshot folder of a dataset repo, holding the files matching `patterns`."""
    from huggingface_hub import snapshot_download

    _announce(ref, "dataset")
    return _download(snapshot_download, ref, "dataset", repo_type="dataset", allow_patterns=patterns)


def fetch_dataset_card(ref: HubRef) -> str | None:
    """A dataset repo's README.md (its card: subsets and their files), or None when the repo has
    none or, offline, the cache has none (the data files may still be cached)."""
    from huggingface_hub import errors as E
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=ref.repo_id, revision=ref.revision, repo_type="dataset",
                               filename="README.md")
    except E.EntryNotFoundError:  # no card, or (offline, no network) no cached card
        return None
    except (E.HfHubHTTPError, E.OfflineModeIsEnabled, E.HFValidationError) as e:
        raise hub_error(e, ref, "dataset") from None
    except OSError as e:
        raise UserError(f"{ref}: cannot fetch from the Hugging Face Hub ({type(e).__name__}: {e})") from None
