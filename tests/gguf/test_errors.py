"""Bad GGUF files: one line naming what is wrong, exit 2, no traceback, nothing written."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter

from tests.errors.workdir import NODE, run, snapshot
from tests.gguf.files import write_model


def truncated(path):
    write_model(path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def wrong_magic(path):
    write_model(path, "llama")
    path.write_bytes(b"GGUX" + path.read_bytes()[4:])


def unknown_arch(path):
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def unsupported_type(path):
    write_model(path, "llama", {"blk.1.ffn_up.weight": "Q2_K"})


def corrupt_type_id(path):
    write_model(path, "llama")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2   # n_dims (u32), two dims (u64), then the type (u32)
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def shape_disagrees(path):
    write_model(path, "llama", shapes={"blk.1.attn_k.weight": (64, 256)})


def not_a_file(path):
    pass


CASES = [
    ("truncated", truncated, "truncated"),
    ("wrong-magic", wrong_magic, "not a GGUF file"),
    ("unknown-arch", unknown_arch, "'mamba'"),
    ("unsupported-type", unsupported_type, "blk.1.ffn_up.weight' is Q2_K"),
    ("corrupt-type-id", corrupt_type_id, "unknown ggml type"),
    ("shape-disagrees", shape_disagrees, "blk.1.attn_k.weight"),
    ("missing", not_a_file, "no such file"),
]


@pytest.mark.parametrize("name,make,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_gguf_is_one_line_exit_2(tmp_path, capsys, monkeypatch, name, make, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "node.yaml").write_text(NODE)
    make(tmp_path / "m.gguf")
    before = snapshot(tmp_path)
    code, out, err = run(["compile", "m.gguf", "--hw", "node.yaml", "-o", "out.json"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    assert snapshot(tmp_path) == before


def test_exec_with_another_file_than_compiled_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "node.yaml").write_text(NODE)
    write_model(tmp_path / "a.gguf", "llama", {"attn_v.weight": "Q6_K"})
    write_model(tmp_path / "b.gguf", "llama", {"attn_v.weight": "Q8_0"})
    assert run(["compile", "a.gguf", "--hw", "node.yaml", "-o", "plan.json", "--prompt-len", "4",
                "--gen-len", "2"], capsys)[0] == 0
    before = snapshot(tmp_path)
    code, _, err = run(["exec", "plan.json", "--weights", "b.gguf", "--prompt-ids", "1,2,3,4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not the file the plan was compiled from" in err
    assert snapshot(tmp_path) == before
    code, _, err = run(["exec", "plan.json", "--weights", "random", "--prompt-ids", "1,2,3,4"], capsys)
    assert code == 2 and "run it with --weights set to that .gguf file" in err, err


def test_exec_of_a_deepseek2_file_runs_from_the_command_line(tmp_path, capsys, monkeypatch):
    from tests.gguf.files import Dims, write_deepseek2
    monkeypatch.chdir(tmp_path)
    (tmp_path / "node.yaml").write_text(NODE)
    write_deepseek2(tmp_path / "ds.gguf", Dims(layers=2, hidden=256, heads=4, experts=4, expert_ffn=64), split_kv_b=True)
    assert run(["compile", "ds.gguf", "--hw", "node.yaml", "-o", "plan.json", "--prompt-len", "4",
                "--gen-len", "2"], capsys)[0] == 0
    code, out, err = run(["exec", "plan.json", "--weights", "ds.gguf", "--prompt-ids", "1,2,3,4"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("drop", ["attn_v_b", "attn_k_b"])
def test_a_deepseek2_file_without_its_kv_b_is_one_line_exit_2(tmp_path, capsys, monkeypatch, drop):
    from gguf import GGUFReader
    from tests.gguf.files import Dims, write_deepseek2
    monkeypatch.chdir(tmp_path)
    write_deepseek2(tmp_path / "full.gguf", Dims(layers=2, hidden=256, heads=4, experts=4, expert_ffn=64),
                    split_kv_b=True)
    reader = GGUFReader(str(tmp_path / "full.gguf"))
    w = GGUFWriter(str(tmp_path / "ds.gguf"), "deepseek2")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name != f"blk.1.{drop}.weight":
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = run(["compile", "ds.gguf", "--hw", "cpu-64g", "-o", "plan.json"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no tensor 'blk.1.{drop}.weight'" in err and not (tmp_path / "plan.json").exists()
