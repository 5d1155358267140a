"""Fill in the middle (issue 37, section 5): a model whose GGUF names FIM tokens (or whose
tokenizer has the known ones) gets llama.cpp's prompt, [BOS] PRE prefix SUF suffix MID, on
`/api/generate` (`suffix`, Continue's autocomplete with `raw`, a short `num_predict` and `stop`),
`/v1/completions` (`suffix`) and the protocol's `generate`; a model without them: a 400
naming why."""
from __future__ import annotations

import json

import pytest

from test_http import afetch
from edgepaged.testing.serving import serving
from edgepaged.client import ServerError, open_client
from edgepaged.request.frontend import Caller, FrontEnd
from edgepaged.request.protocol import GenerateRequest

PREFIX = "def add(a, b):\n    <|im_start|>"      # code that holds a control string: it stays text
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    from edgepaged.model import ModelRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    d = tmp_path_factory.mktemp("fim")
    hf = make_family_model(d / "q", "qwen2", seed=4)
    return ModelRunner(write_family_gguf(d / "q", d / "coder.gguf", hf, qtype=8), num_blocks=128), d / "q"


async def test_the_prompt_is_llama_cpps_and_every_door_takes_suffix(coder):
    runner, folder = coder
    tok = runner.tokenizer
    pre, suf, mid = tok.fim
    assert [tok.tok.id_to_token(i) for i in tok.fim] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    async with serving(runner, http=True) as http:
        req = (await http.front.build(GenerateRequest("x", "generate", prompt=PREFIX, suffix=SUFFIX, max_tokens=4),
                                      Caller("c", "c"))).req
        assert req.prompt_ids == [pre] + tok.encode_plain(PREFIX) + [suf] + tok.encode_plain(SUFFIX) + [mid]
        assert tok.tok.token_to_id("<|im_start|>") not in req.prompt_ids          # the code's text stays text
        model = http.front.model
        status, _, raw = await afetch(http.http_base + "/api/generate", {        # Continue's autocomplete
            "model": model, "prompt": PREFIX, "suffix": SUFFIX, "raw": True, "stream": False,
            "options": {"num_predict": 8, "temperature": 0, "stop": ["\n\n"]}})
        out = json.loads(raw)
        assert status == 200 and out["done"] and out["eval_count"] <= 8, raw
        assert out["prompt_eval_count"] == len(req.prompt_ids)
        status, _, raw = await afetch(http.http_base + "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX,
                                                                     "max_tokens": 6, "temperature": 0})
        out = json.loads(raw)
        assert status == 200 and out["usage"]["prompt_tokens"] == len(req.prompt_ids), raw
        async with open_client(http.address) as c:
            text, done = await c.generate(PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0).collect()
        assert done["usage"]["prompt_tokens"] == len(req.prompt_ids)


def test_the_known_tokens_without_the_files_keys(coder):
    """A Hugging Face folder (no GGUF keys): the tokenizer's known FIM texts."""
    from edgepaged.model.tokenizer import Tokenizer
    _, folder = coder
    tok = Tokenizer.load(folder)
    assert tok.fim is not None and tok.tok.id_to_token(tok.fim[2]) == "<|fim_middle|>"


async def test_a_model_without_fim_tokens_says_why(embedded_runner):
    async with serving(embedded_runner, http=True) as http:
        for path, body in (("/api/generate", {"model": http.front.model, "prompt": "x", "suffix": "y",
                                              "stream": False}),
                           ("/v1/completions", {"prompt": "x", "suffix": "y", "max_tokens": 2})):
            status, _, raw = await afetch(http.http_base + path, body)
            assert status == 400 and b"fill-in-the-middle" in raw, raw
        status, _, raw = await afetch(http.http_base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "suffix": "y"})
        assert status == 400 and b"/v1/completions" in raw
        async with open_client(http.address) as c:
            with pytest.raises(ServerError) as e:
                await c.generate("x", suffix="y", max_tokens=2).collect()
            assert e.value.code == "invalid_params" and "fill-in-the-middle" in str(e.value)
