"""Wire contracts: compact encoding, strict decoding, versioned topics, partitioning."""

from __future__ import annotations

import random

import pytest
from kafka.partitioner.default import murmur2 as kafka_murmur2

from sluice.bus.codec import decode, encode
from sluice.bus.errors import DecodeError
from sluice.bus.messages import (
    Cancel,
    GenerateRequest,
    PromptLogprob,
    SamplingSpec,
    TokenDelta,
    TokenDeltaBatch,
    TopLogprob,
)
from sluice.bus.partitioner import murmur2, partition_for
from sluice.bus.topics import (
    CONTROL_TOPIC,
    TOKENS_TOPIC,
    Lane,
    parse_request_topic,
    pool_id,
    request_topic,
)


def request() -> GenerateRequest:
    return GenerateRequest(
        request_id="req-1",
        tenant_id="t-1",
        model="tiny-llama",
        lane=Lane.INTERACTIVE,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingSpec(temperature=0.0, max_tokens=8, stop=["\n"]),
        reply_to="gw-1",
        created_ms=1,
    )


def test_messages_round_trip_compactly() -> None:
    msg = request()
    raw = encode(msg)
    assert b" " not in raw.replace(b'"\\n"', b"")
    assert decode(request_topic(Lane.INTERACTIVE, "m"), raw) == msg
    batch = TokenDeltaBatch(
        reply_to="gw-1", deltas=[TokenDelta(request_id="r", seq_no=0, token_ids=[5], text="hi")]
    )
    assert decode(TOKENS_TOPIC, encode(batch)) == batch


def test_prompt_logprobs_round_trip_and_are_left_out_when_none() -> None:
    top = [TopLogprob(token_id=7, logprob=-0.5)]
    prompt = [None, PromptLogprob(token_id=9, logprob=-1.25, rank=2, top=top)]
    delta = TokenDelta(request_id="r", seq_no=0, token_ids=[5], prompt_logprobs=prompt)
    batch = TokenDeltaBatch(reply_to="gw-1", deltas=[delta])
    assert decode(TOKENS_TOPIC, encode(batch)) == batch
    # a delta without them reads as before: readers that predate the field decode it
    plain = encode(TokenDeltaBatch(reply_to="gw-1", deltas=[TokenDelta(request_id="r", seq_no=1)]))
    assert b"prompt_logprobs" not in plain


def test_topics_carry_a_version_suffix() -> None:
    assert request_topic(Lane.BATCH, "tiny-llama") == "sluice.requests.tiny-llama.batch.v1"
    assert TOKENS_TOPIC.endswith(".v1")


def test_each_model_pool_has_its_own_lanes_named_by_a_topic_safe_pool_id() -> None:
    assert pool_id("smollm2-135m-instruct") == "smollm2-135m-instruct"
    dotted, underscored = pool_id("org/model.v2"), pool_id("org_model_v2")
    assert dotted != underscored and dotted.startswith("org_model_v2-")
    topic = request_topic(Lane.INTERACTIVE, dotted)
    assert parse_request_topic(topic) == (dotted, Lane.INTERACTIVE)
    assert parse_request_topic(TOKENS_TOPIC) is None
    assert decode(topic, encode(request())) == request()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"not json", "not a valid GenerateRequest"),
        (b'{"request_id": "r"}', "tenant_id"),
        (encode(request())[:-1] + b',"surprise":1}', "surprise"),
        (encode(request()).replace(b'"schema_version":1', b'"schema_version":2'), "schema_version"),
    ],
)
def test_bad_bytes_raise_a_permanent_decode_error(raw: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment) as info:
        decode(request_topic(Lane.STANDARD, "m"), raw)
    assert info.value.retryable is False


def test_unknown_topic_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="no message type"):
        decode("nobody.v1", b"{}")


def test_cancel_names_exactly_one_target() -> None:
    assert decode(CONTROL_TOPIC, encode(Cancel(request_id="r", tenant_id="t"))) is not None
    with pytest.raises(ValueError, match="exactly one"):
        Cancel(tenant_id="t")
    with pytest.raises(ValueError, match="exactly one"):
        Cancel(request_id="r", batch_id="b", tenant_id="t")


def test_partitioner_matches_kafkas_murmur2() -> None:
    rng = random.Random(7)
    for _ in range(500):
        key = rng.randbytes(rng.randint(0, 40))
        assert murmur2(key) == kafka_murmur2(key) & 0xFFFFFFFF
    assert partition_for(b"tenant-a", 6) == partition_for(b"tenant-a", 6)
    assert partition_for(b"x", 1) == 0
