"""Writes the fuzz regression corpus (tests/corpus/*.bin): byte streams a client sends
after its hello. Run it again to regenerate; tests/test_fuzz.py replays every file."""
import pathlib

import msgpack

HERE = pathlib.Path(__file__).parent / "corpus"


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def m(obj) -> bytes:
    return frame(msgpack.packb(obj, use_bin_type=True))


def nested(depth):
    x = 1
    for _ in range(depth):
        x = [x]
    return x


CASES = {
    "random_bytes": bytes(range(256)) * 3,
    "truncated_frame": frame(msgpack.packb({"type": "stats", "id": 1}))[:-3],
    "huge_length": (2**31).to_bytes(4, "big") + b"\x81",
    "zero_length": b"\x00\x00\x00\x00",
    "deep_nesting": frame(b"\x91" * 5000 + b"\x01"),
    "deep_nesting_in_map": m({"type": "chat", "id": 1, "messages": nested(200)}),
    "not_a_map": m([1, 2, 3]),
    "int_keys": frame(msgpack.packb({1: 2})),
    "ext_type": frame(b"\x81\xa4type\xd4\x05\x01"),
    "timestamp_ext": frame(b"\x81\xa4type\xd6\xff\x00\x00\x00\x01"),
    "invalid_utf8": frame(b"\x82\xa4type\xa8generate\xa6prompt\xa4\xff\xfe\xfd\xfc"),
    "trailing_bytes": frame(msgpack.packb({"type": "stats"}) + b"\x00"),
    "unknown_op": m({"type": "reboot", "id": 1}),
    "type_not_string": m({"type": 7}),
    "no_type": m({"id": 1}),
    "wrong_types": m({"type": "chat", "id": [1], "messages": "hi", "max_tokens": "many"}),
    "bool_as_int": m({"type": "generate", "id": 1, "prompt": "x", "max_tokens": True}),
    "out_of_range_params": m({"type": "generate", "id": 1, "prompt": "x", "temperature": -3, "top_p": 7,
                              "top_k": -1, "seed": -5, "max_tokens": 2}),
    "huge_max_tokens": m({"type": "generate", "id": 1, "prompt": "x", "max_tokens": 2**62}),
    "nan_temperature": m({"type": "generate", "id": 1, "prompt": "x", "temperature": float("nan"), "max_tokens": 2}),
    "huge_id": m({"type": "stats", "id": 2**64 - 1}),
    "negative_huge_id": m({"type": "stats", "id": -2**63}),
    "long_id": m({"type": "stats", "id": "x" * 1000}),
    "bad_message": m({"type": "chat", "id": 1, "messages": [{"role": "user"}], "max_tokens": 2}),
    "prompt_longer_than_context": m({"type": "generate", "id": 1, "prompt": "lorem ipsum " * 6000, "max_tokens": 2}),
    "cancel_unknown": m({"type": "cancel", "id": 99}),
    "duplicate_ids": m({"type": "generate", "id": 1, "prompt": "hello", "max_tokens": 3}) * 3,
    "hello_twice": m({"type": "hello", "version": 1}),
    "bad_priority": m({"type": "generate", "id": 1, "prompt": "x", "priority": "urgent", "max_tokens": 2}),
    "many_stops": m({"type": "generate", "id": 1, "prompt": "x", "stop": ["a"] * 1000, "max_tokens": 2}),
    "stop_token_ids_wrong": m({"type": "generate", "id": 1, "prompt": "x", "stop_token_ids": [-1, "a"]}),
    "flood_of_requests": b"".join(m({"type": "generate", "id": i, "prompt": "hi", "max_tokens": 2})
                                  for i in range(40)),
    "valid_then_garbage": m({"type": "generate", "id": 1, "prompt": "hi", "max_tokens": 2}) + b"\xff" * 9,
}

if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    for name, data in CASES.items():
        (HERE / f"{name}.bin").write_bytes(data)
    print(f"wrote {len(CASES)} files to {HERE}")
