"""The package as a user installs it: a wheel built from the package's sources, installed into a fresh virtual
environment and run from a folder outside the source tree. Its dependencies (torch, transformers, the GGUF model) come
from this test's environment through a path file, which adds those folders without running their ``.pth`` files, so
the editable install of the checkout is not visible there. The shipped drafter is package data, so a tree
``generate`` with it proves the wheel holds everything inference needs."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the build reads (pyproject.toml names the packages and their package data)
SOURCES = ("pyproject.toml", "README.md", "hf_treespec", "trainers")

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import hf_treespec
    from hf_treespec.assets import default_drafter, load_target

    here = Path(hf_treespec.__file__).resolve()
    assert Path(sys.prefix).resolve() in here.parents, f"imported {here}, not the wheel installed in {sys.prefix}"
    model, tok = load_target("smollm2-135m-instruct")
    drafter = default_drafter(model)
    inputs = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    tree = hf_treespec.enable(model).generate(**inputs, assistant_model=drafter, tree_policy="salf", tree_budget=8,
                                              do_sample=False, max_new_tokens=16, return_dict_in_generate=True)
    assert tree.sequences.tolist() == plain.tolist(), (tree.sequences, plain)
    assert tree.drafted_steps > 0 and max(tree.accepted_lengths) > 1, "trees were drafted and accepted"
    print("wheel ok", here.parent, sum(tree.accepted_lengths) / len(tree.accepted_lengths))
""")


def _copy_sources(into: Path) -> None:
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, into / name)


@pytest.mark.real_model
@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_and_generates(tmp_path):
    sources, dist, env = tmp_path / "src", tmp_path / "dist", tmp_path / "env"
    sources.mkdir()
    _copy_sources(sources)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(sources)], check=True)
    wheels = list(dist.glob("hf_treespec-*.whl"))
    assert len(wheels) == 1, wheels
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    env_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    (Path(env_site) / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])], check=True)
    run = subprocess.run([str(python), "-I", "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wheel ok" in run.stdout
    command = subprocess.run([str(env / "bin" / "hf-treespec"), "bench", "--help"], cwd=tmp_path, capture_output=True,
                             text=True)
    assert command.returncode == 0 and "--methods" in command.stdout, command.stderr[-2000:]
