"""A vision model's pixels (`model/vision.py`) equal transformers' own image processors' for
the same image: SmolVLM's (Idefics3: resize, tiles and the global view) and Gemma 3's, on a
camera frame (1280 x 720), a small image (one tile), a portrait photo and an odd size."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgepaged.model.vision import gemma3_pixels, idefics3_pixels

SIZES = [(1280, 720), (300, 200), (500, 900), (777, 333)]


def _photo(w, h, seed=0):
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_smolvlm_tiles_equal_transformers(size):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    img = _photo(*size)
    # SmolVLM-256M-Instruct's preprocessor_config: longest edge 2048, tiles of 512, mean/std 0.5
    hf = Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                   image_mean=[0.5] * 3, image_std=[0.5] * 3)
    want = hf(images=[[img]], return_tensors="np", return_row_col_info=True)
    got, rows, cols = idefics3_pixels(img, 2048, 512)
    assert got.shape == want["pixel_values"][0].shape
    assert (rows, cols) == (want["rows"][0][0], want["cols"][0][0])
    assert np.abs(got - want["pixel_values"][0]).max() <= 1e-6
    assert want["pixel_attention_mask"].all()          # every tile whole: no padding to carry


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemma3_pixels_equal_transformers(size):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    img = _photo(*size, seed=1)
    hf = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    want = hf(images=[img], return_tensors="np")["pixel_values"]
    got = gemma3_pixels(img, 896)
    assert got.shape == want.shape == (1, 3, 896, 896)
    assert np.abs(got - want).max() <= 1e-6


def test_smolvlm_s_tower_and_connector_give_transformers_image_features():
    """A tiny Idefics3 (SmolVLM's architecture) from transformers' own classes, random
    weights: the numpy SigLIP tower, pixel shuffle and projection over the processor's tiles
    of a camera frame give its `get_image_features` within 1e-4."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    from edgepaged.model.vision import SiglipTower, idefics3_image_tokens
    torch.manual_seed(0)
    cfg = Idefics3Config(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=16),
        text_config=dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2),
        scale_factor=2, image_token_id=299)
    hf = Idefics3ForConditionalGeneration(cfg).eval()
    tiles, rows, cols = idefics3_pixels(_photo(1280, 720), longest_edge=256, tile=64)
    assert (rows, cols) == (3, 4) and tiles.shape == (13, 3, 64, 64)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(tiles)[None]).pooler_output[0].numpy()
    state = {k: v.numpy() for k, v in hf.model.state_dict().items()}
    tower = SiglipTower(state, layers=2, heads=4, patch=16, prefix="vision_model.")
    got = idefics3_image_tokens(tower, state["connector.modality_projection.proj.weight"], tiles, scale=2)
    assert got.shape == want.shape == (13 * 4, 48)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def test_gemma3_s_tower_and_projector_give_transformers_image_features():
    """A tiny Gemma 3 (transformers' own classes, random weights): the numpy SigLIP tower,
    the average pool, the soft-embedding norm and the projection over the processor's pixels
    give its `get_image_features` within 1e-4."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from edgepaged.model.vision import SiglipTower, gemma3_image_tokens
    torch.manual_seed(0)
    cfg = Gemma3Config(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8),
        text_config=dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        mm_tokens_per_image=16, image_token_index=299, boi_token_index=297, eoi_token_index=298)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # a projector that is not all zeros, and a norm not all ones
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
        hf.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.1)
    pixels = gemma3_pixels(_photo(1280, 720, seed=2), size=64)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output.reshape(-1, 48).numpy()
    state = {k: v.numpy() for k, v in hf.model.state_dict().items()}
    tower = SiglipTower(state, layers=2, heads=4, patch=8, prefix="vision_tower.")
    mm = "multi_modal_projector."
    got = gemma3_image_tokens(tower, state[mm + "mm_soft_emb_norm.weight"], state[mm + "mm_input_projection_weight"],
                              pixels, tokens_per_image=16)
    assert got.shape == want.shape == (16, 48)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def _round_to_f16(model, keep_f32=(".embeddings.",)):
    """The 2-D weights an mmproj stores in F16, rounded so in the model too (the reference)."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not any(k in name for k in keep_f32):
                p.copy_(p.half().float())


@pytest.mark.parametrize("family", ["idefics3", "gemma3"])
def test_an_mmproj_file_as_llama_cpp_writes_it_gives_the_same_image_features(family, tmp_path):
    """The tower and projector written as llama.cpp's converter writes an mmproj GGUF (names
    from gguf-py's own map, F16 weights, Gemma's norm + 1), read back by `read_mmproj`: the
    image features of transformers' model (its weights rounded to F16 as the file keeps them)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Idefics3Config, \
        Idefics3ForConditionalGeneration

    from edgepaged.model.vision import gemma3_image_tokens, idefics3_image_tokens, read_mmproj, tower_from_mmproj
    from edgepaged.testing.vision_models import write_mmproj
    torch.manual_seed(1)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                  patch_size=16 if family == "idefics3" else 8)
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    if family == "idefics3":
        hf = Idefics3ForConditionalGeneration(Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                                                             image_token_id=299)).eval()
        pixels, _, _ = idefics3_pixels(_photo(640, 480, seed=3), longest_edge=128, tile=64)
    else:
        hf = Gemma3ForConditionalGeneration(Gemma3Config(
            vision_config=vision, text_config={**text, "head_dim": 16}, mm_tokens_per_image=16, image_token_index=299,
            boi_token_index=297, eoi_token_index=298)).eval()
        with torch.no_grad():
            hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
            hf.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.1)
        pixels = gemma3_pixels(_photo(640, 480, seed=3), size=64)
    _round_to_f16(hf)
    path = write_mmproj(hf, tmp_path / f"mmproj-{family}.gguf", family, longest_edge=128)
    kind, hp, weights = read_mmproj(path)
    assert kind == family and hp["image_size"] == 64 and hp["block_count"] == 2
    assert hp["image_mean"] == pytest.approx([0.5] * 3)
    _, _, tower, proj = tower_from_mmproj(path)
    with torch.no_grad():
        x = torch.from_numpy(pixels)
        want = hf.model.get_image_features(x[None] if family == "idefics3" else x).pooler_output
        want = (want[0] if family == "idefics3" else want).reshape(-1, 48).numpy()
    if family == "idefics3":
        got = idefics3_image_tokens(tower, proj["connector.proj.weight"], pixels, scale=2)
    else:      # the file keeps Gemma's norm as 1 + w: the function adds the 1 itself
        got = gemma3_image_tokens(tower, proj["projector.norm.weight"] - 1.0, proj["projector.input.weight"], pixels,
                                  tokens_per_image=16, eps=float(hp["attention.layer_norm_epsilon"]))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    with pytest.raises(ValueError, match="not a vision projector"):
        from edgepaged.testing.families import make_family_model, write_family_gguf
        m = make_family_model(tmp_path / "t", "llama")
        read_mmproj(write_family_gguf(tmp_path / "t", tmp_path / "t.gguf", m))


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    """A tiny SmolVLM written as a GGUF repository ships one (model + mmproj)."""
    from edgepaged.testing.vision_models import make_smolvlm
    return make_smolvlm(tmp_path_factory.mktemp("smolvlm"))


def _image_prompt(runner, hf, img):
    """(our ids: the image's rows as its ids past the vocabulary; transformers' ids, the
    processor's image token there; the tiles), for "User:<image>What is it?"."""
    from edgepaged.model.image_table import digest
    from edgepaged.model.vision import IMAGE
    enc, tok = runner.vision, runner.tokenizer
    pixels, layout = enc.pixels(img)
    base = runner.images.put(digest(img.tobytes()), enc.encode(pixels), layout)
    ours, theirs, k = [], [], 0
    for t in enc.prompt_tokens(layout, tok):
        ours.append(t if t != IMAGE else base + k)
        theirs.append(t if t != IMAGE else hf.config.image_token_id)
        k += t == IMAGE
    head, tail = tok.encode_plain("User:"), tok.encode_plain("What is it?")
    return head + ours + tail, head + theirs + tail, pixels


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
def test_smolvlm_s_logits_for_an_image_and_a_question_equal_transformers(smolvlm, runtime):
    """The model file and mmproj as a Hugging Face GGUF repository ships them, served by the
    CPU runtime (Rust kernels) and by the torch reference: the logits after an image (its
    tiles, wrapped in SmolVLM's own tokens) and a question are transformers'
    Idefics3ForConditionalGeneration's within 1e-3."""
    import torch

    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.decode import make_allocator, prompt_logits
    hf, model, mmproj = smolvlm
    runner = CpuRunner(model, num_blocks=64) if runtime == "cpu" else ModelRunner(model, num_blocks=64)
    runner.attach_vision(mmproj, math="exact")
    ours, theirs, pixels = _image_prompt(runner, hf, _photo(640, 480, seed=4))
    assert pixels.shape == (5, 3, 64, 64) and sum(t >= runner.images.first for t in ours) == 20
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([theirs]), pixel_values=torch.from_numpy(pixels)[None]).logits[0, -1].numpy()
    got = np.asarray(prompt_logits(runner, make_allocator(runner), ours))[-1]
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    if runtime == "cpu":     # the tower on the integer kernels (what --quant-math auto picks): close, not exact
        fast = CpuRunner(model, num_blocks=64)
        fast.attach_vision(mmproj, math="int8")
        assert fast.vision.tower.math == "int8"
        ids, _, _ = _image_prompt(fast, hf, _photo(640, 480, seed=4))
        got8 = np.asarray(prompt_logits(fast, make_allocator(fast), ids))[-1]
        assert 0 < np.abs(got8 - want).max() <= 5e-2 * max(1.0, np.abs(want).max())
    # a text-only model's file with a projector of another width is refused, naming both
    with pytest.raises(ValueError, match="not a pair"):
        from edgepaged.testing.vision_models import make_smolvlm
        ModelRunner(make_smolvlm(Path(model).parent / "wide", hidden=96)[1], num_blocks=8).attach_vision(mmproj)


@pytest.fixture(scope="module")
def gemma3vlm(tmp_path_factory):
    """A tiny Gemma 3 in both layouts (model + mmproj; Ollama's single file)."""
    from edgepaged.testing.vision_models import make_gemma3_vlm
    return make_gemma3_vlm(tmp_path_factory.mktemp("gemma3vlm"))


def _gemma3_prompt(runner, hf, img):
    """(our ids, transformers' ids, its token_type_ids, the pixels) for
    "<bos><start_of_turn>user\\n" + the image + "What is it?<end_of_turn>\\n<start_of_turn>model\\n"."""
    from edgepaged.model.image_table import digest
    from edgepaged.model.vision import IMAGE
    enc, tok = runner.vision, runner.tokenizer
    pixels, layout = enc.pixels(img)
    base = runner.images.put(digest(img.tobytes()), enc.encode(pixels), layout)
    head = [tok.bos_token_id] + tok.encode("<start_of_turn>user\n", add_special_tokens=False)
    tail = tok.encode("What is it?<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False)
    ours, theirs, k = [], [], 0
    for t in enc.prompt_tokens(layout, tok):
        ours.append(t if t != IMAGE else base + k)
        theirs.append(t if t != IMAGE else hf.config.image_token_index)
        k += t == IMAGE
    types = [0] * len(head) + [int(t == IMAGE) for t in enc.prompt_tokens(layout, tok)] + [0] * len(tail)
    return head + ours + tail, head + theirs + tail, types, pixels


@pytest.mark.parametrize("runtime, layout", [("cpu", "llama.cpp"), ("cpu", "ollama"), ("torch", "llama.cpp"),
                                             ("torch", "ollama")])
def test_gemma3_s_logits_for_an_image_equal_transformers_with_its_image_tokens_both_ways(gemma3vlm, runtime, layout):
    """Gemma 3 as a Hugging Face GGUF repository ships it (model + mmproj) and as Ollama's
    single file (the tower inside the model's GGUF), on the CPU runtime and the torch
    reference: the logits after an image and a question are transformers' within 1e-3, its
    image tokens attending to their whole image (transformers' token_type_ids mask: without
    it the logits differ, so the test sees the difference)."""
    import torch

    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.decode import make_allocator, prompt_logits
    hf, model, mmproj, ollama = gemma3vlm
    path = ollama if layout == "ollama" else model
    # (an f32 KV cache: f16's rounding alone moves these logits ~2e-3, the text model's as much)
    runner = (CpuRunner(path, num_blocks=64, kv_dtype="f32") if runtime == "cpu"
              else ModelRunner(path, num_blocks=64, kv_dtype="f32"))
    runner.attach_vision(ollama if layout == "ollama" else mmproj, math="exact")
    assert runner.vision.kind == "gemma3" and runner.images.both_ways and runner.vision.tokens_per_tile == 16
    ours, theirs, types, pixels = _gemma3_prompt(runner, hf, _photo(640, 480, seed=6))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([theirs]), pixel_values=torch.from_numpy(pixels),
                  token_type_ids=torch.tensor([types])).logits[0, -1].numpy()
        causal = hf(input_ids=torch.tensor([theirs]), pixel_values=torch.from_numpy(pixels)).logits[0, -1].numpy()
    got = np.asarray(prompt_logits(runner, make_allocator(runner), ours))[-1]
    scale = max(1.0, np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-3 * scale
    assert np.abs(causal - want).max() > 1e-2 * scale       # (both ways matters here)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_llava_pixels_equal_clip_s_processor(size):
    """LLaVA-1.5's pixels (CLIP's processor at 336: the shorter edge, the centre, CLIP's mean
    and std) equal transformers' within 1e-6."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from edgepaged.model.vision import llava_pixels
    img = _photo(*size, seed=2)
    hf = CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    want = hf(images=img, return_tensors="np")["pixel_values"]
    got = llava_pixels(img, 336)
    assert got.shape == want.shape == (1, 3, 336, 336)
    assert np.abs(got - want).max() <= 1e-6


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
def test_llava_s_logits_for_an_image_equal_transformers(tmp_path, runtime):
    """A tiny LLaVA-1.5 (transformers' LlavaForConditionalGeneration) with its projector as
    llama.cpp's older converter writes it (the last layer left out, fc1/fc2 named the old way,
    mm.0 / mm.2): the CPU runtime and the torch reference give transformers' logits after an
    image and a question within 1e-3 (its features from the layer before the last, the class
    token dropped)."""
    import torch

    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.image_table import digest
    from edgepaged.model.vision import IMAGE
    from edgepaged.testing.decode import make_allocator, prompt_logits
    from edgepaged.testing.vision_models import make_llava
    hf, model, mmproj = make_llava(tmp_path / "llava")
    runner = (CpuRunner(model, num_blocks=64, kv_dtype="f32") if runtime == "cpu"
              else ModelRunner(model, num_blocks=64, kv_dtype="f32"))
    runner.attach_vision(mmproj, math="exact")
    enc, tok = runner.vision, runner.tokenizer
    assert enc.kind == "mlp" and enc.tokens_per_tile == 16 and enc.tower.layers == 2
    img = _photo(300, 200, seed=8)
    pixels, layout = enc.pixels(img)
    base = runner.images.put(digest(img.tobytes()), enc.encode(pixels), layout)
    head, tail = tok.encode_plain("USER: "), tok.encode_plain("\nWhat is it?\nASSISTANT:")
    rows = enc.prompt_tokens(layout, tok)
    ours = head + [base + k for k in range(len(rows))] + tail
    theirs = head + [hf.config.image_token_index] * len(rows) + tail
    assert rows == [IMAGE] * 16
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([theirs]), pixel_values=torch.from_numpy(pixels)).logits[0, -1].numpy()
    got = np.asarray(prompt_logits(runner, make_allocator(runner), ours))[-1]
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("d", [64, 72])
def test_the_tower_s_attention_every_patch_to_every_patch(d):
    """The tower's attention (`segment_attention` over one segment: BLAS around the Rust
    softmax) for SigLIP-B's 64-wide heads and SigLIP-so400m's 72 equals a plain softmax
    attention over all positions, also for a segment long enough to go in blocks of rows."""
    from edgepaged.model.vision import SiglipTower
    rng = np.random.default_rng(d)
    t, nh = (300 if d == 64 else 700), 4
    h = nh * d
    qkv = rng.standard_normal((t, 3 * h), dtype=np.float32)
    got = SiglipTower._attention(qkv, t, nh, d)
    q, k, v = (qkv[:, i * h:(i + 1) * h].reshape(t, nh, d).transpose(1, 0, 2).astype(np.float64) for i in range(3))
    s = q @ k.transpose(0, 2, 1) * d ** -0.5
    s = np.exp(s - s.max(-1, keepdims=True))
    want = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(t, h)
    assert np.abs(got - want).max() <= 1e-5


# ---------------------------------------------------------------- Qwen2.5-VL

@pytest.mark.parametrize("size", SIZES + [(40, 30), (4000, 3000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_qwen25vl_pixels_equal_transformers(size):
    """Qwen2.5-VL's pixels (dynamic resolution: edges to multiples of 28 within the area
    bounds, bicubic, CLIP's mean and std, patches in 2 x 2 blocks, each twice in time) and
    its grid equal transformers' processor's, for a camera frame, photos, an image under the
    least area (40 x 30: scaled up) and one over the most (4000 x 3000: scaled down)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from edgepaged.model.vision import qwen2vl_pixels
    img = _photo(*size, seed=9)
    want = Qwen2VLImageProcessorPil()(images=[img], return_tensors="np")
    got, gh, gw = qwen2vl_pixels(img)
    assert [1, gh, gw] == want["image_grid_thw"][0].tolist()
    assert got.shape == want["pixel_values"].shape and got.shape[1] == 3 * 2 * 14 * 14
    assert np.abs(got - want["pixel_values"]).max() <= 1e-6
    assert 56 * 56 <= gh * gw * 14 * 14 <= 28 * 28 * 1280


def test_qwen25vl_refuses_an_image_200_times_longer_than_wide():
    from edgepaged.model.vision import qwen2vl_pixels
    with pytest.raises(ValueError, match="200"):
        qwen2vl_pixels(Image.new("RGB", (4020, 20)))


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory):
    """A tiny Qwen2.5-VL in both layouts (model + mmproj; Ollama's single file)."""
    from edgepaged.testing.vision_models import make_qwen25vl
    return make_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


def _qwen_prompt(runner, hf, img):
    """(our ids, transformers' ids, its mm_token_type_ids, the processor's output) for
    "User:" + <|vision_start|> + the image + <|vision_end|> + a question."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from edgepaged.model.image_table import digest
    from edgepaged.model.vision import IMAGE
    enc, tok = runner.vision, runner.tokenizer
    pixels, layout = enc.pixels(img)
    base = runner.images.put(digest(img.tobytes()), enc.encode(pixels), layout)
    vs, ve = (tok.tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    rows = enc.prompt_tokens(layout, tok)
    assert rows == [IMAGE] * (layout[0] * layout[1])
    head, tail = tok.encode_plain("User:"), tok.encode_plain("What is on this photo? Tell me more")
    ours = head + [vs] + [base + k for k in range(len(rows))] + [ve] + tail
    theirs = head + [vs] + [hf.config.image_token_id] * len(rows) + [ve] + tail
    kinds = [[int(t == hf.config.image_token_id) for t in theirs]]
    return ours, theirs, kinds, Qwen2VLImageProcessorPil()(images=[img], return_tensors="np")


@pytest.mark.parametrize("runtime, layout", [("cpu", "llama.cpp"), ("cpu", "ollama"), ("torch", "llama.cpp"),
                                             ("torch", "ollama")])
def test_qwen25vl_s_logits_for_an_image_equal_transformers_with_its_multimodal_positions(qwen25vl, runtime, layout):
    """A tiny Qwen2.5-VL as llama.cpp writes it (qwen2vl + mmproj "qwen2.5vl_merger") and as
    Ollama does (qwen25vl, the tower inside), on the CPU runtime and the torch reference: the
    logits at every position of an image (230 x 150: 5 x 8 feature rows; windows of 4 x 4,
    some cut at the edge; two full-attention layers) and a question equal transformers'
    Qwen2_5_VLForConditionalGeneration's within 1e-3 — the image's rows at their (t, h, w)
    rotary positions, the text after it from t + max(h, w); with every row at its index
    instead they differ by far more (the check can fail)."""
    import torch

    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.decode import make_allocator, prompt_logits
    hf, model, mmproj, ollama = qwen25vl
    path, proj = (model, mmproj) if layout == "llama.cpp" else (ollama, ollama)
    runner = (CpuRunner(path, num_blocks=64, kv_dtype="f32") if runtime == "cpu"
              else ModelRunner(path, num_blocks=64, kv_dtype="f32"))
    runner.attach_vision(proj, math="exact")
    assert runner.config.rope_sections == (2, 3, 3) and runner.images.mrope and runner.vision.marker == "<|image_pad|>"
    ours, theirs, kinds, px = _qwen_prompt(runner, hf, _photo(230, 150, seed=5))
    assert px["image_grid_thw"].tolist() == [[1, 10, 16]]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([theirs]), pixel_values=torch.from_numpy(px["pixel_values"]),
                  image_grid_thw=torch.from_numpy(px["image_grid_thw"]),
                  mm_token_type_ids=torch.tensor(kinds)).logits[0].numpy()
    got = np.asarray(prompt_logits(runner, make_allocator(runner), ours, every=True))
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    runner.images.mrope = False           # every row at its index: not Qwen2.5-VL's answer
    flat = np.asarray(prompt_logits(runner, make_allocator(runner), ours, every=True))
    assert np.abs(flat - want).max() > 1e-1


def test_a_qwen25vl_projector_and_a_model_without_multimodal_positions_are_no_pair(qwen25vl, smolvlm):
    """Qwen2.5-VL's projector beside a model whose rotary is plain (or the other way round):
    refused at load, naming both."""
    from edgepaged.model.cpu.runner import CpuRunner
    _, model, mmproj, _ = qwen25vl
    with pytest.raises(ValueError, match="not a pair"):
        CpuRunner(smolvlm[1], num_blocks=8).attach_vision(mmproj)
    with pytest.raises(ValueError, match="not a pair"):
        CpuRunner(model, num_blocks=8).attach_vision(smolvlm[2])


@pytest.mark.parametrize("d", [32, 80])
def test_windowed_attention_inside_each_segment(d):
    """The windowed ViT's attention: each segment's rows see exactly their segment (segments
    of unequal lengths), for 32- and 80-wide heads (Qwen2.5-VL's)."""
    from edgepaged.model.vision import segment_attention
    rng = np.random.default_rng(d)
    nh, cu = 3, np.array([0, 64, 128, 144, 200, 204])
    t, h = cu[-1], nh * d
    qkv = rng.standard_normal((t, 3 * h), dtype=np.float32)
    got = segment_attention(qkv, cu, nh, d)
    want = np.empty((t, h))
    for a, b in zip(cu[:-1], cu[1:]):
        q, k, v = (qkv[a:b, i * h:(i + 1) * h].reshape(b - a, nh, d).transpose(1, 0, 2).astype(np.float64)
                   for i in range(3))
        s = q @ k.transpose(0, 2, 1) * d ** -0.5
        s = np.exp(s - s.max(-1, keepdims=True))
        want[a:b] = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(b - a, h)
    assert np.abs(got - want).max() <= 1e-5


def test_the_torch_runner_s_towers_give_the_cpu_towers_features(smolvlm, gemma3vlm, qwen25vl, tmp_path):
    """The torch runner runs each family's tower on its device (model/torch/vision.py: the GPU
    on a GPU box; here the CPU): SmolVLM's tiles, Gemma 3's SigLIP, LLaVA's CLIP and
    Qwen2.5-VL's windowed ViT and merger give the CPU runtime's numpy towers' feature rows
    within 1e-4."""
    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.torch.vision import TorchQwenTower, TorchSiglip
    from edgepaged.testing.vision_models import make_llava
    pairs = [(smolvlm[1], smolvlm[2]), (gemma3vlm[1], gemma3vlm[2]), (qwen25vl[1], qwen25vl[2]),
             make_llava(tmp_path / "llava")[1:]]
    img = _photo(300, 200, seed=6)
    for model, mmproj in pairs:
        cpu, gpu = CpuRunner(model, num_blocks=8), ModelRunner(model, num_blocks=8)
        cpu.attach_vision(mmproj, math="exact")
        gpu.attach_vision(mmproj)
        assert isinstance(gpu.vision.tower, (TorchSiglip, TorchQwenTower))
        pixels, layout = cpu.vision.pixels(img)
        want = cpu.vision.encode(pixels)
        got = gpu.vision.encode(pixels, pause=lambda: None)
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), cpu.vision.kind
