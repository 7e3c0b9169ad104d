"""genserve.client.Client against a real in-process server (tiny random model)."""

from __future__ import annotations

import json
import re
import socket
import time

import grpc
import jsonschema
import pytest

from genserve.client import (
    BatchItem,
    Client,
    GenerateResult,
    GenserveError,
    build_request,
)
from genserve.v1 import generation_pb2 as pb
from genserve.v1 import generation_pb2_grpc as pb_grpc

Code = grpc.StatusCode
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(address):
    with Client(address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def raw(address):
    """The generated stub on its own channel: what the client must agree with."""
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- request building (no server) ---------------------------------------------------------

def test_build_request_maps_every_option():
    req = build_request(PROMPT, dict(
        max_new_tokens=8, min_new_tokens=2, stop="\n", stop_token_ids=[2], ignore_eos=True,
        include_stop_sequence=True, time_limit_ms=500, temperature=0.7, top_k=5, top_p=0.9,
        min_p=0.1, typical_p=0.95, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, seed=7, n=2, regex="[a-z]+", structured_backend="xgrammar",
        logprobs=True, top_logprobs=3, return_token_ids=True, return_prompt_token_ids=True,
        truncate_input_tokens=100, speculative=False, request_id="r1",
        processors=[("banned_phrases", {"phrases": ["x"]}), ("no_repeat_window", "{}")]))
    assert req.prompt == PROMPT and req.request_id == "r1" and req.truncate_input_tokens == 100
    s = req.sampling
    assert (s.temperature, s.top_k, s.seed, s.n) == (pytest.approx(0.7), 5, 7, 2)
    assert s.top_p == pytest.approx(0.9) and s.frequency_penalty == pytest.approx(-0.5)
    st = req.stopping
    assert (st.max_new_tokens, st.min_new_tokens, list(st.stop_sequences),
            list(st.stop_token_ids), st.ignore_eos, st.include_stop_sequence,
            st.time_limit_ms) == (8, 2, ["\n"], [2], True, True, 500)
    assert req.structured_output.regex == "[a-z]+"
    assert req.structured_output.backend == pb.STRUCTURED_BACKEND_XGRAMMAR
    o = req.output
    assert (o.logprobs, o.top_logprobs, o.return_token_ids, o.return_prompt_token_ids) == (
        True, 3, True, True)
    assert req.HasField("speculative") and req.speculative.enabled is False
    assert [(p.name, json.loads(p.args_json)) for p in req.processors] == [
        ("banned_phrases", {"phrases": ["x"]}), ("no_repeat_window", {})]


def test_build_request_leaves_unset_options_to_the_server():
    req = build_request("hi")
    for name in ("temperature", "top_p", "seed", "n"):
        assert not req.sampling.HasField(name)
    assert not req.stopping.HasField("max_new_tokens")
    assert not req.HasField("structured_output") and not req.HasField("speculative")


def test_build_request_prompt_kinds():
    assert list(build_request([1, 2, 3]).prompt_token_ids.ids) == [1, 2, 3]
    chat = build_request([{"role": "user", "content": "Hi"}]).chat
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Hi")]
    assert chat.add_generation_prompt
    assert not build_request([{"role": "user", "content": "Hi"}],
                             {"add_generation_prompt": False}).chat.add_generation_prompt
    ready = pb.GenerateRequest(prompt="x")
    assert build_request(ready) is ready


def test_build_request_structured_kinds():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(build_request("x", {"json_schema": schema})
                      .structured_output.json_schema) == schema
    assert build_request("x", {"json_schema": '{"type": "string"}'}).structured_output \
        .json_schema == '{"type": "string"}'
    assert build_request("x", {"json_object": True}).structured_output.json_object
    assert list(build_request("x", {"choice": ["a", "b"]})
                .structured_output.choice.choices) == ["a", "b"]
    assert build_request("x", {"grammar": 'root ::= "a"'}).structured_output.grammar


@pytest.mark.parametrize("prompt,options,error", [
    ("x", {"max_tokens": 3}, "unknown generate option"),
    ("x", {"regex": "a", "choice": ["a"]}, "at most one structured-output option"),
    ("x", {"structured_backend": "outlines", "regex": "a"}, "structured_backend must be"),
    ("x", {"structured_backend": "xgrammar"}, "needs a structured-output option"),
    ("x", {"choice": "ab"}, "sequence of strings"),
    ([1, "a"], {}, "prompt must be"),
    ([True], {}, "prompt must be"),
    (b"x", {}, "not bytes"),
    ([{"content": "no role"}], {}, "a chat message"),
    (pb.GenerateRequest(prompt="x"), {"seed": 1}, "ready GenerateRequest"),
])
def test_build_request_rejects_bad_shapes(prompt, options, error):
    with pytest.raises((TypeError, ValueError), match=error):
        build_request(prompt, options)


def test_channel_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="both certificate_chain and private_key"):
        Client("localhost:1", certificate_chain=b"x")
    with pytest.raises(ValueError, match="load_balancing"):
        Client("localhost:1", load_balancing="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_attempts"):
        Client("localhost:1", max_attempts=0)
    with pytest.raises(OSError, match="cannot read the TLS root certificates"):
        Client("localhost:1", root_certificates=str(tmp_path / "missing.pem"))
    config = json.loads(dict(Client("localhost:1", max_attempts=3).settings
                             .channel_options())["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["methodConfig"][0]["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


# ---- generation -------------------------------------------------------------------------

def test_generate_matches_the_raw_stub(client, raw):
    result = client.generate(PROMPT, max_new_tokens=8)
    assert isinstance(result, GenerateResult)
    resp = raw.Generate(pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(
        max_new_tokens=8)), timeout=60)
    assert result.text == resp.completions[0].text and result.text
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == resp.usage.prompt_tokens
    assert result.request_id and len(result.completions) == 1


def test_generate_token_ids_and_chat_prompts(client, raw):
    ids = client.tokenize(PROMPT).token_ids
    assert client.generate(list(ids), max_new_tokens=6).text == \
        client.generate(PROMPT, max_new_tokens=6).text
    messages = [{"role": "user", "content": "Hi"}]
    resp = raw.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")],
                             add_generation_prompt=True),
        stopping=pb.StoppingCriteria(max_new_tokens=6)), timeout=60)
    assert client.generate(messages, max_new_tokens=6).text == resp.completions[0].text


def test_generate_output_options(client):
    r = client.generate(PROMPT, max_new_tokens=4, logprobs=True, top_logprobs=2,
                        return_token_ids=True, return_prompt_token_ids=True, request_id="mine")
    assert r.request_id == "mine"
    c = r.completions[0]
    assert len(c.token_ids) == 4 and len(c.logprobs) == 4
    assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in c.logprobs)
    assert r.prompt_token_ids == client.tokenize(PROMPT).token_ids
    d = r.to_dict()
    assert json.loads(json.dumps(d)) == d and d["completions"][0]["token_ids"] == list(c.token_ids)


def test_token_texts_ranks_prompt_logprobs_and_seed(client, tokenizer):
    r = client.generate(PROMPT, max_new_tokens=3, logprobs=True, top_logprobs=2,
                        prompt_logprobs=True, temperature=1.2, return_token_ids=True)
    c = r.completions[0]
    assert [lp.text for lp in c.logprobs] == tokenizer.convert_ids_to_tokens(list(c.token_ids))
    assert all(lp.rank >= 1 for lp in c.logprobs)
    prompt_ids = client.tokenize(PROMPT).token_ids
    assert [lp.token_id for lp in r.prompt_logprobs] == list(prompt_ids[1:])
    assert r.seed is not None
    again = client.generate(PROMPT, max_new_tokens=3, temperature=1.2, seed=r.seed)
    assert again.text == r.text and again.seed == r.seed
    d = r.to_dict()
    assert d["seed"] == r.seed and len(d["prompt_logprobs"]) == len(prompt_ids) - 1
    assert client.model_info().max_new_tokens == 1024


def test_stop_sequence(client):
    full = client.generate(PROMPT, max_new_tokens=8).completions[0]
    stop = full.text[len(full.text) // 2:][:4]
    r = client.generate(PROMPT, max_new_tokens=8, stop=[stop])
    assert r.finish_reason == "stop_sequence" and r.completions[0].stop_sequence == stop
    assert r.text == full.text[:full.text.index(stop)]


def test_seeded_sampling_with_n(client):
    a = client.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=3, n=2)
    b = client.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=3, n=2)
    assert [c.index for c in a.completions] == [0, 1]
    assert [c.text for c in a.completions] == [c.text for c in b.completions]
    assert a.usage.completion_tokens == 12


def test_structured_output(client):
    r = client.generate(PROMPT, choice=["yes", "no"], max_new_tokens=8)
    assert r.text in ("yes", "no")
    r = client.generate(PROMPT, regex=r"[0-9]{3}", max_new_tokens=8)
    assert re.fullmatch(r"[0-9]{3}", r.text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.generate(PROMPT, json_schema=schema, max_new_tokens=32)
    jsonschema.validate(r.json(), schema)


def test_generate_batch_items_and_errors(client):
    items = client.generate_batch(["1, 2, 3,", "", "a, b, c,"], max_new_tokens=5)
    assert [i.index for i in items] == [0, 1, 2]
    assert all(isinstance(i, BatchItem) for i in items)
    assert items[0].ok and items[2].ok and not items[1].ok
    assert items[1].error is not None and items[1].error.code == Code.INVALID_ARGUMENT
    assert "prompt must not be empty" in items[1].error.details
    with pytest.raises(GenserveError, match="invalid request"):
        items[1].unwrap()
    assert items[0].unwrap().text == client.generate("1, 2, 3,", max_new_tokens=5).text
    assert items[2].unwrap().usage.completion_tokens == 5
    mixed = client.generate_batch([pb.GenerateRequest(
        prompt="x", request_id="own", stopping=pb.StoppingCriteria(max_new_tokens=2)), "y"],
        max_new_tokens=3)
    assert mixed[0].unwrap().request_id == "own"
    assert mixed[0].unwrap().usage.completion_tokens == 2
    assert mixed[1].unwrap().usage.completion_tokens == 3


def test_generate_batch_whole_call_error(client):
    with pytest.raises(GenserveError) as e:
        client.generate_batch([])
    assert e.value.code == Code.INVALID_ARGUMENT
    with pytest.raises(TypeError):
        client.generate_batch("abc")
    with pytest.raises(TypeError, match="request_id is per item"):
        client.generate_batch(["a"], request_id="x")


def test_generate_stream(client):
    expected = client.generate(PROMPT, max_new_tokens=8)
    with client.generate_stream(PROMPT, max_new_tokens=8) as stream:
        chunks = list(stream)
    assert "".join(c.text for c in chunks) == expected.text == stream.text
    assert len(chunks) >= 2 and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" == stream.finish_reason
    assert stream.usage == expected.usage
    assert stream.request_id == chunks[0].request_id != ""


def test_generate_stream_n_and_cancel(client, server):
    stream = client.generate_stream(PROMPT, max_new_tokens=5, n=2, temperature=1.0, seed=1)
    chunks = list(stream)
    assert set(stream.texts) == {0, 1}
    assert {c.index for c in chunks if c.finish_reason} == {0, 1}
    with client.generate_stream(PROMPT, max_new_tokens=200, min_new_tokens=200,
                                ignore_eos=True) as long:
        next(long)
    # leaving the block cancelled the call: the engine drops the request
    end = time.monotonic() + 10
    while server.stats.num_requests and time.monotonic() < end:
        time.sleep(0.05)
    assert server.stats.num_requests == 0


# ---- errors -----------------------------------------------------------------------------

def test_invalid_argument(client):
    with pytest.raises(GenserveError) as e:
        client.generate(PROMPT, top_p=1.5)
    err = e.value
    assert err.code == Code.INVALID_ARGUMENT and not err.retryable
    assert "top_p" in err.details
    assert str(err) == f"invalid request: {err.details}"
    with pytest.raises(GenserveError) as e:
        list(client.generate_stream(PROMPT, top_p=1.5))
    assert e.value.code == Code.INVALID_ARGUMENT


def test_deadline_exceeded(client):
    with pytest.raises(GenserveError) as e:
        client.generate(PROMPT, max_new_tokens=200, min_new_tokens=200, timeout=0.05)
    assert e.value.code == Code.DEADLINE_EXCEEDED
    assert str(e.value).startswith("deadline exceeded (0.05s)")
    with pytest.raises(GenserveError) as e:
        list(client.generate_stream(PROMPT, max_new_tokens=200, min_new_tokens=200,
                                    timeout=0.3))
    assert e.value.code == Code.DEADLINE_EXCEEDED


def test_unavailable():
    with Client(f"127.0.0.1:{_free_port()}", timeout=5) as c:
        with pytest.raises(GenserveError) as e:
            c.generate("x")
        assert e.value.code == Code.UNAVAILABLE and e.value.retryable
        assert str(e.value).startswith("server unavailable")
        with pytest.raises(GenserveError, match="not SERVING after 0.5s"):
            c.wait_until_serving(0.5)


# ---- the rest ---------------------------------------------------------------------------

def test_tokenize(client, tokenizer):
    t = client.tokenize("Hello world", return_tokens=True)
    assert list(t.token_ids) == tokenizer("Hello world")["input_ids"]
    assert t.tokens == tuple(tokenizer.convert_ids_to_tokens(list(t.token_ids)))
    assert client.tokenize("Hello world").tokens == ()


def test_model_info(client, tokenizer):
    info = client.model_info()
    assert info.max_model_len == 256 and info.vocab_size == len(tokenizer)
    assert info.eos_token_ids == (tokenizer.eos_token_id,)
    assert "json_schema" in info.structured_backends["xgrammar"]
    assert info.speculative_method is None and info.speculative_k == 0


def test_health(client):
    assert client.health() == "SERVING"
    assert client.health("genserve.v1.GenerationService") == "SERVING"
    client.wait_until_serving(5)
    with pytest.raises(GenserveError) as e:
        client.health("no.such.Service")
    assert e.value.code == Code.NOT_FOUND


def test_metadata_and_wait_for_ready(address):
    with Client(address, metadata=[("x-tenant", "a")], wait_for_ready=True,
                load_balancing=None) as c:
        assert c.generate("Hi", max_new_tokens=2).usage.completion_tokens == 2
