"""Regenerates this folder's ONNX files with optimum's own exporter (``optimum-cli export onnx``).

optimum-onnx needs ``transformers<4.58``, which the test suite (transformers 5) cannot share, so
the files are made once in a separate environment and kept here; the tests only read them:

    python3 -m venv /tmp/optimum && /tmp/optimum/bin/pip install torch==2.13.0 \\
        optimum-onnx==0.1.0 optimum==2.1.0 transformers==4.57.3 onnx==1.23.2
    /tmp/optimum/bin/python tests/onnx/optimum/make.py

Each model is the tests' tiny llama / gpt2 (``tests.onnx.exports.SMALL``), randomly initialised
with a fixed seed, norm scales and biases drawn too; exported with ``--task text-generation``
(``{family}.onnx``) and ``--task text-generation-with-past`` (``{family}-past.onnx``), at
optimum's default opset, weights inside the file.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent
SMALL = {"llama": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
         "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=96)}


def model_dir(family: str, out: Path) -> Path:
    torch.manual_seed(0)
    config = (transformers.LlamaConfig if family == "llama" else transformers.GPT2Config)(**SMALL[family])
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:   # no norm scale or bias an exporter could fold away
                p.copy_((1.0 if "weight" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(out / family)
    return out / family


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for family in SMALL:
            src = model_dir(family, tmp)
            for task, name in (("text-generation", f"{family}.onnx"), ("text-generation-with-past", f"{family}-past.onnx")):
                dest = tmp / f"{family}-{task}"
                subprocess.run([sys.executable, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model",
                                str(src), "--task", task, "--no-post-process", str(dest)], check=True)
                shutil.copyfile(dest / "model.onnx", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
