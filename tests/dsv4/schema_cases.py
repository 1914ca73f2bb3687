"""The table of bad requests fed through the JSONL reader (tests/experiments/test_serve.py) and through `generate`
(tests/dsv4/test_schema.py). Each: (name, JSON object or raw line, substring of the expected error, whether the case
can be expressed through `generate` as (prompt, SamplingParams(**other keys)))."""

GOOD_PROMPT = [0] + [3, 4, 5, 6, 7] * 8        # BOS + filler: any token ids in range of the 64-token vocab

BAD = [
    ("seed_negative", {"prompt": GOOD_PROMPT, "seed": -1}, "seed must be an integer in [0, 2^32)", True),
    ("seed_too_big", {"prompt": GOOD_PROMPT, "seed": 2**32}, "seed must be an integer in [0, 2^32)", True),
    ("top_k_too_big", {"prompt": GOOD_PROMPT, "top_k": 2**31}, "top_k must be an integer in [0, 2^31)", True),
    ("max_tokens_null", {"prompt": GOOD_PROMPT, "max_tokens": None}, "max_tokens", True),
    ("max_tokens_float", {"prompt": GOOD_PROMPT, "max_tokens": 2.0}, "max_tokens must be >= 1", True),
    ("max_tokens_zero", {"prompt": GOOD_PROMPT, "max_tokens": 0}, "max_tokens must be >= 1", True),
    ("prompt_string", {"prompt": "1234"}, "prompt must be a list of integer token ids, got str", True),
    ("prompt_float_id", {"prompt": [0, 3, 4.0, 5]}, "prompt[2] must be an integer token id, got float", True),
    ("prompt_bool_id", {"prompt": [0, 3, True, 5]}, "prompt[2] must be an integer token id, got bool", True),
    ("prompt_out_of_range", {"prompt": [0, 3, 10**9]}, "token id 1000000000 out of range [0, 64)", True),
    ("prompt_negative", {"prompt": [0, -3]}, "token id -3 out of range", True),
    ("prompt_empty", {"prompt": []}, "empty prompt", True),
    ("ignore_eos_string", {"prompt": GOOD_PROMPT, "ignore_eos": "false"}, "ignore_eos must be true or false", True),
    ("temperature_negative", {"prompt": GOOD_PROMPT, "temperature": -1.0}, "temperature must be", True),
    ("temperature_string", {"prompt": GOOD_PROMPT, "temperature": "0.5"}, "temperature must be", True),
    ("top_p_zero", {"prompt": GOOD_PROMPT, "top_p": 0.0}, "top_p must be", True),
    ("stop_float", {"prompt": GOOD_PROMPT, "stop_token_ids": [1.5]}, "stop_token_ids[0] must be an integer", True),
    ("unknown_key", {"prompt": GOOD_PROMPT, "max_new_tokens": 4}, "unknown key(s) 'max_new_tokens'", False),
    ("tenant_not_string", {"prompt": GOOD_PROMPT, "tenant": 5}, "tenant must be a string", False),
    ("session_null", {"prompt": GOOD_PROMPT, "session": None}, "'session' must not be null", False),
    ("prompt_missing", {"max_tokens": 2}, "missing key 'prompt'", False),
    ("not_an_object", [1, 2, 3], "a request must be a JSON object", False),
    ("malformed_json", '{"prompt": [1, 2', "not valid JSON", False),
]
