"""Incremental detokenization equals decoding all the ids at once, token by token, for a
byte-level BPE and a sentencepiece-style (byte-fallback, `▁`) tokenizer, on random ids that split
multi-byte UTF-8 characters; and stop strings found on that text are cut where they must be."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from hf_reference import build_sentencepiece_style_tokenizer
from vllm_lite import SamplingParams
from vllm_lite.engine.detokenizer import (FastIncrementalDetokenizer, SlowIncrementalDetokenizer, TokenPieces,
                                          fast_backend, new_detokenizer)
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.sampling_params import RequestOutputKind
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason

NUM_CASES = 40
NUM_IDS = 24


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece_style"])
def tokenizer(request, tiny_tokenizer_dir):
    if request.param == "byte_level_bpe":
        return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return build_sentencepiece_style_tokenizer()


def _byte_ids(tokenizer) -> list[int]:
    """The id of the token that is exactly byte b, for b in 0..255: `<0xNN>` pieces, or GPT-2's
    byte -> character alphabet for byte-level BPE."""
    vocab = tokenizer.get_vocab()
    if "<0x80>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in range(256)]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [vocab[char[b]] for b in range(256)]


def _random_ids(tokenizer, rng: np.random.Generator, lone_bytes: bool = False) -> list[int]:
    """Whole tokens mixed with random multi-byte characters (2 to 4 UTF-8 bytes) fed one byte
    token at a time; with `lone_bytes`, also bytes that form no character. Never special tokens."""
    special = set(tokenizer.all_special_ids)
    byte_ids = _byte_ids(tokenizer)
    ordinary = [i for i in range(len(tokenizer)) if i not in special and i not in set(byte_ids)]
    ids: list[int] = []
    while len(ids) < NUM_IDS:
        draw = rng.random()
        if draw < 0.4:
            ids.append(int(rng.choice(ordinary)))
        elif draw < 0.9 or not lone_bytes:
            codepoint = int(rng.choice([rng.integers(0x80, 0x800), rng.integers(0x4E00, 0x9FFF),
                                        rng.integers(0x1F300, 0x1F64F)]))
            ids.extend(byte_ids[b] for b in chr(codepoint).encode())
        else:
            ids.append(byte_ids[int(rng.integers(0x80, 0x100))])
    return ids


def _run(detokenizer, ids: list[int]) -> tuple[list[str], str]:
    pieces = [detokenizer.add_token(i) for i in ids]
    return pieces, detokenizer.flush()


def _make(kind: str, tokenizer, prompt: list[int]):
    if kind == "fast":
        return FastIncrementalDetokenizer(fast_backend(tokenizer), prompt, skip_special_tokens=True)
    if kind == "fast with pieces":
        return FastIncrementalDetokenizer(fast_backend(tokenizer), prompt, True, TokenPieces.for_tokenizer(tokenizer))
    return SlowIncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)


def test_fast_path_is_chosen_for_fast_tokenizers(tokenizer) -> None:
    assert isinstance(new_detokenizer(tokenizer, [], True), FastIncrementalDetokenizer)

    class OnlyDecode:  # a tokenizer without a `tokenizers` backend takes the slow path
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    assert isinstance(new_detokenizer(OnlyDecode(), [], True), SlowIncrementalDetokenizer)


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_random_ids_without_prompt_equal_decode(tokenizer, kind: str) -> None:
    rng = np.random.default_rng(7)
    split_seen = False
    # Lone bytes only for byte-level BPE: there invalid bytes decode to one replacement character
    # each whatever follows; byte-fallback groups may stop decoding when an invalid byte joins
    # (see test_byte_fallback_invalid_group_recovers).
    lone_bytes = "<0x80>" not in tokenizer.get_vocab()
    for _ in range(NUM_CASES):
        ids = _random_ids(tokenizer, rng, lone_bytes)
        pieces, tail = _run(_make(kind, tokenizer, []), ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=True), ids
        assert all(not piece.endswith("\ufffd") or tokenizer.decode(ids).count("\ufffd") for piece in pieces)
        split_seen |= any(piece == "" for piece in pieces)
    assert split_seen  # some token completed no character: a multi-byte character was split


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_random_ids_after_a_prompt_equal_decode_of_the_whole(tokenizer, kind: str) -> None:
    """After a prompt the text is what decoding prompt + output adds to the prompt's text."""
    rng = np.random.default_rng(11)
    prompt = tokenizer.encode("The quick brown fox, 你好 🙂 and", add_special_tokens=False)
    prompt_text = tokenizer.decode(prompt)
    for _ in range(NUM_CASES):
        ids = _random_ids(tokenizer, rng)
        pieces, tail = _run(_make(kind, tokenizer, prompt), ids)
        whole = tokenizer.decode(prompt + ids)
        assert whole.startswith(prompt_text)
        assert "".join(pieces) + tail == whole[len(prompt_text):], ids


@pytest.mark.parametrize("kind", ["fast", "fast with pieces", "slow"])
@pytest.mark.parametrize("cut", [0, 1, 2, 3])
def test_a_prompt_ending_inside_a_character_leaves_it_to_the_output(tokenizer, kind: str, cut: int) -> None:
    """The prompt's last character split (its bytes as byte tokens): the prompt's text is the
    whole characters before it, and the output's text what decoding prompt + output adds to that
    (the split character's bytes included, completed or not); none of the prompt's own text
    comes out again."""
    rng = np.random.default_rng(13)
    byte_ids = _byte_ids(tokenizer)
    emoji = [byte_ids[b] for b in "🙂".encode()]
    prompt = tokenizer.encode("The quick brown fox, 你好 and", add_special_tokens=False) + emoji[:len(emoji) - cut]
    before = tokenizer.decode(prompt[:len(prompt) - len(emoji) + cut] if cut else prompt)  # its whole characters
    assert tokenizer.decode(prompt).endswith("\ufffd") == (cut > 0)  # (cut 0: the emoji whole in the prompt)
    rest = emoji[len(emoji) - cut:] + tokenizer.encode(" ok", add_special_tokens=False)
    pieces, tail = _run(_make(kind, tokenizer, prompt), rest)
    assert "".join(pieces) + tail == ("🙂 ok" if cut else " ok")
    # Random output after the split character leaves its bytes invalid UTF-8: only byte-level BPE
    # decodes those alike whole and token by token (one replacement character per byte).
    for _ in range(20 if "<0x80>" not in tokenizer.get_vocab() else 0):
        ids = _random_ids(tokenizer, rng)[:20]
        pieces, tail = _run(_make(kind, tokenizer, prompt), ids)
        full = tokenizer.decode(prompt + ids)
        assert full.startswith(before) and "".join(pieces) + tail == full[len(before):], ids


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_decode_rest_equals_token_by_token(tokenizer, kind: str) -> None:
    """A request decoded only at its end gets the text the token-by-token path gives."""
    rng = np.random.default_rng(13)
    prompts = [tokenizer.encode("The quick brown fox, 你好 🙂 and", add_special_tokens=False), []]
    for case in range(NUM_CASES):
        prompt = prompts[case % 2]
        ids = _random_ids(tokenizer, rng)
        pieces, tail = _run(_make(kind, tokenizer, prompt), ids)
        assert _make(kind, tokenizer, prompt).decode_rest(ids) == "".join(pieces) + tail, ids


def test_byte_fallback_invalid_group_recovers() -> None:
    """`<0xD6><0xA0>` decodes to a character, which a following lone `<0xE4>` turns into three
    replacement characters: DecodeStream reports an invalid prefix; the stream restarts and the
    text goes on (what was emitted stays)."""
    tokenizer = build_sentencepiece_style_tokenizer()
    byte_ids = _byte_ids(tokenizer)
    word = tokenizer.encode(" fox", add_special_tokens=False)
    detokenizer = _make("fast", tokenizer, [])
    pieces, tail = _run(detokenizer, [byte_ids[0xD6], byte_ids[0xA0], byte_ids[0xE4], *word])
    assert pieces[1] == "\u05a0" and (("".join(pieces) + tail).endswith(" fox"))


def test_fast_and_slow_emit_the_same_pieces_on_encoded_text(tokenizer) -> None:
    text = "Héllo wörld, 今天天气很好 🙂🚀 x = f(3, [14, 159]) naïve façade"
    ids = tokenizer.encode(text, add_special_tokens=False)
    fast, slow = _run(_make("fast", tokenizer, []), ids), _run(_make("slow", tokenizer, []), ids)
    assert "".join(fast[0]) + fast[1] == text == "".join(slow[0]) + slow[1]
    assert fast == slow


def _stream(tokenizer, ids: list[int], **params) -> tuple[list[str], str | None, int]:
    """Feed `ids` one per step as DELTA; returns the text deltas, the stop reason and how many
    token ids were handed out."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [], SamplingParams(max_tokens=len(ids), ignore_eos=True,
                                                          output_kind=RequestOutputKind.DELTA, **params))
    deltas, stop_reason, num_ids = [], None, 0
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        finished = [FinishedRequest("r", FinishReason.LENGTH)] if last else []
        states, _ = processor.process_outputs(EngineCoreOutputs(["r"], np.array([token_id], np.int32), finished))
        for state in states:
            out = state.make_output()
            if out is not None:
                deltas.append(out.outputs[0].text)
                num_ids += len(out.outputs[0].token_ids)
                stop_reason = out.outputs[0].stop_reason
        if not processor.has_unfinished_requests():
            break
    return deltas, stop_reason, num_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_on_random_text_cut_at_the_first_occurrence(tokenizer, include: bool) -> None:
    """A stop string taken from the middle of the decoded text (spanning pieces) ends the text
    at its first occurrence; without include_stop_str_in_output no delta shows any of it."""
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(NUM_CASES):
        ids = _random_ids(tokenizer, rng)
        text = tokenizer.decode(ids)
        # Not in the tail that only the final flush emits (an incomplete character at the end).
        searchable = text.rstrip("\ufffd")
        start = int(rng.integers(1, max(len(searchable) - 4, 2)))
        stop = searchable[start:start + 3]
        if len(stop) < 3 or stop.endswith("\ufffd"):
            continue
        deltas, stop_reason, _ = _stream(tokenizer, ids, stop=[stop], include_stop_str_in_output=include)
        first = text.find(stop)
        assert stop_reason == stop
        assert "".join(deltas) == text[:first + len(stop) if include else first]
        checked += 1
    assert checked >= NUM_CASES // 4


def wordpiece_style_tokenizer():
    """A tokenizer whose decoder puts a space before every token, added ones included (a
    WordPiece decoder over a BPE vocabulary): where spaces_between_special_tokens shows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["hello world this is a test of the tokenizer"] * 20, trainer)
    tokenizer.add_tokens([AddedToken("<tool>", normalized=False)])
    return tokenizer


def vllms_text(tokenizer, token_ids: list[int], prompt: list[int] | None = None) -> str:
    """vLLM's FastIncrementalDetokenizer with spaces_between_special_tokens=False, transcribed:
    the stream (primed with the prompt) gives each token's piece, or an added token's bare
    content right after another added token."""
    from tokenizers.decoders import DecodeStream

    added = {token_id: token.content for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    stream, last_special, text = DecodeStream(ids=prompt or [], skip_special_tokens=False), False, ""
    for token_id in token_ids:
        piece = stream.step(tokenizer, token_id) or ""
        special = added.get(token_id)
        if special is not None and last_special:
            piece = special
        last_special = special is not None
        text += piece
    return text


def test_spaces_between_special_tokens_false_is_vllms() -> None:
    tokenizer = wordpiece_style_tokenizer()
    words = tokenizer.encode("hello world").ids
    s, e, tool = (tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<tool>"))
    rng = np.random.default_rng(0)
    cases = [words + [s, e, tool, s] + words + [e, e]]
    cases += [rng.choice(words + [s, e, tool], size=12).tolist() for _ in range(30)]
    for ids in cases:
        expected = vllms_text(tokenizer, ids)
        joined = new_detokenizer(tokenizer, [], False, spaces_between_special_tokens=False)
        assert "".join(joined.add_token(t) for t in ids) + joined.flush() == expected
        batched = new_detokenizer(tokenizer, [], False, spaces_between_special_tokens=False)
        assert batched.add_tokens(ids[:5]) + batched.decode_rest(ids[5:]) == expected
        spaced = new_detokenizer(tokenizer, [], False)
        spaced_text = "".join(spaced.add_token(t) for t in ids) + spaced.flush()
        assert spaced_text == tokenizer.decode(ids, skip_special_tokens=False)
    # (the case that differs: the decoder spaces them, vLLM's rule joins them)
    assert "<s> </s>" in tokenizer.decode([s, e], skip_special_tokens=False)
    assert vllms_text(tokenizer, [s, e]).endswith("<s></s>")
    # skipped special tokens have no text to join: the request's text is as with spaces
    assert type(new_detokenizer(tokenizer, [], True, spaces_between_special_tokens=False)).__name__ == \
        "FastIncrementalDetokenizer"


def test_spaces_between_special_tokens_reaches_the_output(tiny_llama, tmp_path) -> None:
    """Through LLM.generate: the sampling parameter picks the detokenizer (allowed_token_ids make
    the model write added tokens only)."""
    import json
    import shutil

    from llm_factory import make_llm

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    tokenizer = wordpiece_style_tokenizer()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    specials = [tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<tool>")]
    llm = make_llm(model)
    try:
        texts = {}
        for spaces in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=specials,
                                    skip_special_tokens=False, spaces_between_special_tokens=spaces)
            output = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
            texts[spaces] = (output.text, list(output.token_ids))
    finally:
        llm.shutdown()
    ids, prompt = texts[True][1], [5, 6, 7]
    assert texts[False][1] == ids
    whole, prompt_text = (tokenizer.decode(t, skip_special_tokens=False) for t in (prompt + ids, prompt))
    assert texts[True][0] == whole[len(prompt_text):]
    assert texts[False][0] == vllms_text(tokenizer, ids, prompt) != texts[True][0]
