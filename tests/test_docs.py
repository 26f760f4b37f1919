"""The documentation runs: every ```python block of README.md and docs/*.md is executed, each in a fresh namespace.

Convention (what a documentation block may rely on): blocks are written for the real SmolLM2-135M-Instruct, but
here loading that model by name gives tiny random stand-ins, so the whole file runs in seconds:

- ``AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` (or ``-1.7B-Instruct``) and
  ``hf_treespec.assets.load_target("smollm2-135m-instruct")`` (or the Hub id) return a random 8-layer Llama with a
  64-token vocabulary; ``AutoTokenizer.from_pretrained`` of that id (and ``load_target``'s tokenizer) a
  character-level tokenizer with a chat template (``conftest.char_tokenizer``);
- ``hf_treespec.assets.default_drafter(model)`` on that stand-in returns a random feature drafter laid out as the
  shipped one (EAGLE-3 inputs, the target's embeddings / LM head shared, a ``c2t/`` classifier and a
  ``delay_selector/`` in its folder, so ``tree_policy="c2t"`` / ``"nde"`` find them);
- ``generate`` stops after at most 8 new tokens (a random drafter is rarely accepted, so every token is a step).

Any other model name goes to the real loaders. The drafter model cards (the shipped drafter's ``README.md`` and
``model_cards/drafter_card.md``, rendered with and without a packaged target) run too, their blocks in order in one
namespace, as a reader pastes them; there ``AutoModel.from_pretrained("path/to/drafter")`` loads the random drafter. Blocks run in a temporary working directory (files they write land
there) with ``HF_TREESPEC_CACHE`` pointing into it. ``HF_TREESPEC_DOCS_REAL=1`` runs the blocks on the real models
instead (no stand-ins, no token cap: minutes, and the 1.7B model needs the Hub). Command lines belong in ```bash
blocks, which are not run; ```text blocks hold output. A block that cannot run here has no place in a ```python fence.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SMOLLM2_IDS = {"HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct",
               "HuggingFaceTB/SmolLM2-1.7B-Instruct"}
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .!?+/012345"  # 64 tokens, chat template included
MAX_NEW_TOKENS = 8
REAL = os.environ.get("HF_TREESPEC_DOCS_REAL") == "1"
TEST_COMMAND = "./setup.sh && python -m pytest -q"
MAIN_COMMAND = "./setup.sh && hf-treespec bench --quick"

_FENCE = re.compile(r"^\s*```(\w*)\s*$")
LANGUAGES = {"python", "bash", "text"}


def fenced_blocks(path: Path, text: str | None = None) -> list[tuple[str, int, str]]:
    """``(language, first line number, code)`` of every fenced block of a Markdown file (or of ``text``)."""
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        if language is None:
            match = _FENCE.match(line)
            if match:
                language, start, lines = match.group(1), number + 1, []
        elif line.strip() == "```":
            blocks.append((language, start, textwrap.dedent("\n".join(lines)) + "\n"))
            language = None
        else:
            lines.append(line)
    assert language is None, f"{path.name}: a fence opened at line {start - 1} is never closed"
    return blocks


def python_blocks() -> list:
    """A block that compiles (``CompileConfig()``: inductor, minutes on 2 cores) is marked ``slow`` (CI runs it)."""
    return [pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}",
                         marks=pytest.mark.slow if "CompileConfig()" in code else ())
            for path in DOCS for language, line, code in fenced_blocks(path) if language == "python"]


# ------------------------------------------------------------------------------------------------- stand-ins
def tiny_target(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # peaked distributions, like a real LM's
    model.config._docs_stand_in = True
    return model


def tiny_tokenizer():
    return char_tokenizer(CHARS, chat=True)


def tiny_drafter_folder(folder: Path) -> Path:
    """A random feature drafter for :func:`tiny_target`, saved with the companions the shipped drafter carries."""
    from hf_treespec.drafters import TreeSpecDrafterConfig, TreeSpecDrafterModel
    from hf_treespec.drafters.eagle_io import eagle3_default_target_layers
    from hf_treespec.policies import DelaySelector, DelaySelectorConfig
    from hf_treespec.policies.c2t import C2TClassifier

    target = tiny_target()
    torch.manual_seed(1)
    config = TreeSpecDrafterConfig.for_target(
        target.config, input_mode="eagle3", target_layers=eagle3_default_target_layers(8),
        share_target_embeddings=True, share_target_lm_head=True)
    TreeSpecDrafterModel(config).save_pretrained(folder)
    C2TClassifier().save_pretrained(folder / "c2t")
    DelaySelector(DelaySelectorConfig(actions=[[1, 2, 2], [2, 1, 2]], hidden_inputs={"target_hidden": 32},
                                      shared_dim=8)).save_pretrained(folder / "delay_selector")
    return folder


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory) -> Path:
    return tiny_drafter_folder(tmp_path_factory.mktemp("docs_drafter"))


@pytest.fixture(autouse=True)
def registries_restored():
    """A block may register a policy or verifier of its own (docs/policies.md's example does, as a user would); the
    registries are restored after it, so no other test sees that entry."""
    from hf_treespec.policies import POLICIES
    from hf_treespec.verifiers import VERIFIERS

    before = {registry: set(registry.names()) for registry in (POLICIES, VERIFIERS)}
    yield
    for registry, names in before.items():
        for name in set(registry.names()) - names:
            registry.unregister(name)


@pytest.fixture
def stand_ins(monkeypatch, tmp_path, drafter_folder):
    """Routes every SmolLM2 load to the tiny stand-ins (module docstring) and runs the block in ``tmp_path``."""
    import transformers

    import hf_treespec.assets
    from hf_treespec.drafters import TreeSpecDrafterModel

    model_loader = transformers.AutoModelForCausalLM.from_pretrained
    tokenizer_loader = transformers.AutoTokenizer.from_pretrained
    auto_loader = transformers.AutoModel.from_pretrained
    real_default_drafter = hf_treespec.assets.default_drafter
    monkeypatch.chdir(tmp_path)

    def load_auto(name, *args, **kwargs):  # a model card's "path/to/drafter"
        if str(name) == CARD_DRAFTER:
            name = hf_treespec.assets.shipped_drafter_path() if REAL else drafter_folder
        return auto_loader(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", load_auto)
    if REAL:
        return

    def load_model(name, *args, **kwargs):
        if str(name) in SMOLLM2_IDS:
            return tiny_target(seed=int("1.7B" in str(name))).to(kwargs.get("dtype") or torch.float32)
        return model_loader(name, *args, **kwargs)

    def load_tokenizer(name, *args, **kwargs):
        return tiny_tokenizer() if str(name) in SMOLLM2_IDS else tokenizer_loader(name, *args, **kwargs)

    def load_target(name_or_path="smollm2-135m-instruct", dtype=torch.bfloat16, **kwargs):
        assert str(name_or_path) in SMOLLM2_IDS, f"documentation blocks load SmolLM2 only, not {name_or_path!r}"
        return tiny_target().to(dtype), tiny_tokenizer()

    def default_drafter(model, target="smollm2-135m-instruct", dtype=None):
        if not getattr(model.config, "_docs_stand_in", False):
            return real_default_drafter(model, target, dtype)
        drafter = TreeSpecDrafterModel.from_pretrained(drafter_folder, dtype=dtype or model.dtype)
        return drafter.tie_to_target(model).to(model.device).eval()

    real_generate = transformers.GenerationMixin.generate

    def short_generate(self, *args, **kwargs):
        kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", short_generate)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load_tokenizer)
    monkeypatch.setattr(hf_treespec.assets, "load_target", load_target)
    monkeypatch.setattr(hf_treespec.assets, "default_drafter", default_drafter)
    monkeypatch.setenv("HF_TREESPEC_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("code", python_blocks())
def test_python_block_runs(code, stand_ins, request):
    exec(compile(code, request.node.callspec.id, "exec"), {"__name__": "__docs__"})


# ---------------------------------------------------------------------------------------------- model cards
SHIPPED_CARD = ROOT / "hf_treespec" / "assets_data" / "drafters" / "smollm2-135m-instruct" / "README.md"
CARD_DRAFTER = "path/to/drafter"  # what a card rendered without repo_id loads the drafter from


def card_text(card: str) -> str:
    """The shipped drafter's card, or the card template rendered for the tiny stand-in (``template:asset``: trained
    against a packaged target; ``template:hub``: against ``base_model``'s Hub weights), with both helper sections."""
    if card == "shipped":
        return SHIPPED_CARD.read_text()
    from hf_treespec.drafters import TreeSpecDrafterConfig
    from hf_treespec.model_card import make_card

    config = TreeSpecDrafterConfig.for_target(tiny_target().config)
    helper = {"data": "d", "objective": "o", "results": "r"}
    return make_card(config, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", data="d", objective="o",
                     draft_vocab_size=config.draft_vocab_size, results={"tau": 2.0}, command="c",
                     delay_selector=helper, c2t_classifier=helper,
                     target_asset="smollm2-135m-instruct" if card == "template:asset" else None).content


@pytest.mark.parametrize("card", ["shipped", "template:asset", "template:hub"])
def test_model_card_blocks_run_in_order(card, stand_ins):
    text = card_text(card)
    blocks = [(line, code) for language, line, code in fenced_blocks(Path(card), text) if language == "python"]
    assert len(blocks) == 3, "a card shows its usage, the NDE selector's and the C2T classifier's"
    namespace = {"__name__": "__docs__"}
    for line, code in blocks:
        exec(compile(code, f"{card}:{line}", "exec"), namespace)


def test_tree_policy_snippets_show_how_generate_takes_it():
    """A snippet that calls generate(tree_policy=...) shows enable(...) or custom_generate=: stock generate refuses
    the kwarg, so a reader pasting only that block must see which of the two makes it work."""
    texts = {str(path.relative_to(ROOT)): path.read_text() for path in DOCS}
    texts.update({card: card_text(card) for card in ("shipped", "template:asset", "template:hub")})
    bare = [f"{name}:{line}" for name, text in texts.items()
            for language, line, code in fenced_blocks(Path(name), text)
            if language == "python" and re.search(r"generate\([^)]*tree_policy", code, re.S)
            and "enable(" not in code and "custom_generate=" not in code]
    assert not bare, f"generate(tree_policy=...) without enable or custom_generate: {bare}"


# -------------------------------------------------------------------------------------------- README checks
def test_every_fence_names_its_language():
    for path in DOCS:
        for language, line, _ in fenced_blocks(path):
            assert language in LANGUAGES, (f"{path.name}:{line - 1}: fence language {language!r}; use python (run by "
                                           f"this test), bash (commands) or text (output)")


def test_readme_opens_with_title_pitch_then_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("# hf_treespec\n")
    first_language, _, first_block = fenced_blocks(ROOT / "README.md")[0]
    assert first_language == "bash"
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == [MAIN_COMMAND, TEST_COMMAND]  # CI extracts the test command from here, verbatim


def test_every_docs_page_is_linked_and_has_a_python_block():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"
    for name in ("policies", "verifiers", "drafters", "training", "benchmarking"):
        blocks = fenced_blocks(ROOT / "docs" / f"{name}.md")
        assert any(language == "python" for language, _, _ in blocks), f"docs/{name}.md has no python block"


def test_every_registered_policy_and_verifier_is_in_its_docs_table():
    from hf_treespec.policies import POLICIES
    from hf_treespec.verifiers import VERIFIERS

    for registry, page in ((POLICIES, "policies.md"), (VERIFIERS, "verifiers.md")):
        text = (ROOT / "docs" / page).read_text()
        rows = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \|", text, re.MULTILINE)}
        assert set(registry) <= rows, f"docs/{page} has no row for {sorted(set(registry) - rows)}"


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def test_readme_counts_policies_and_verifiers_from_the_registry():
    from hf_treespec.policies import POLICIES
    from hf_treespec.verifiers import VERIFIERS

    match = re.search(r"(\w+) tree-growing \*\*policies\*\* and (\w+) verifiers", (ROOT / "README.md").read_text())
    assert match, "README no longer says how many policies and verifiers there are"
    assert match.groups() == (NUMBER_WORDS[len(POLICIES.names())], NUMBER_WORDS[len(VERIFIERS.names())])


README_SECTIONS = ["What it is", "Install", "Quick start with your own model", "Which options to pick",
                   "What to expect on your hardware", "Limits"]


def test_readme_is_for_users_short_and_in_order():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README has {len(lines)} lines (at most 250: details go to docs/)"
    wide = [number for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not wide, f"README lines longer than 120 characters: {wide}"
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert headings[: len(README_SECTIONS)] == README_SECTIONS
    for page in ("docs/architecture.md", "CONTRIBUTING.md", "docs/glossary.md"):
        assert f"({page})" in text, f"README does not link {page}"


def architecture_map_paths() -> list[str]:
    """The paths the architecture map (docs/architecture.md, "Folder map") names in its first column (``a/b.py``,
    ``c.py``: the second is in the first one's folder)."""
    section = ARCHITECTURE.read_text().split("## Folder map", 1)[1].split("\n## ", 1)[0]
    paths = []
    for cell in re.findall(r"^\| ([^|]+) \|", section, re.MULTILINE):
        names = re.findall(r"`([^`]+)`", cell)
        if not names:  # the header
            continue
        folder = str(Path(names[0]).parent) if "/" in names[0].rstrip("/") else ""
        paths += [names[0]] + [name if "/" in name.rstrip("/") else f"{folder}/{name}" for name in names[1:]]
    return [path.rstrip("/") for path in paths]


def test_architecture_map_names_existing_paths_once():
    paths = architecture_map_paths()
    assert paths and len(paths) == len(set(paths)), "a module is listed twice"
    for path in paths:
        assert (ROOT / path).exists(), f"the architecture map names {path}, which does not exist"


def test_architecture_map_covers_every_folder_and_root_module():
    """The map matches the folders: every subpackage of the package and of the trainers, and every module at the
    package root, has its row (or a name in one)."""
    named = set(architecture_map_paths())
    trainers_row = ARCHITECTURE.read_text().split("| `trainers/` |", 1)[1].split("\n", 1)[0]
    package = ROOT / "hf_treespec"
    expected = {f"hf_treespec/{p.name}" for p in package.glob("*.py")}
    expected |= {f"hf_treespec/{p.name}" for p in package.iterdir()
                 if p.is_dir() and not p.is_symlink() and ((p / "__init__.py").exists() or p.name == "assets_data")}
    missing = sorted(expected - named)
    assert not missing, f"the architecture map (docs/architecture.md) has no row for {missing}"
    subfolders = sorted(p.name for p in (ROOT / "trainers").iterdir() if (p / "__init__.py").exists())
    assert subfolders and all(f"`{name}/`" in trainers_row for name in subfolders), \
        f"the trainers row names {subfolders}?"


def test_relative_links_resolve():
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"
