"""Streaming detokenization on the default model's byte-level tokenizer: whole characters only."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tide.serving.detokenizer import REPLACEMENT, Detokenizer

SAMPLES = [
    "Le cœur a ses raisons que la raison ne connaît point. Ça va? Déjà vu, naïve façade.",
    "Größenwahn: Die Straße führt über die Brücke, Äpfel und Öl für 5 €.",
    "我喜欢吃中国菜，因为它很好吃。東京は日本の首都です。",
    "Emoji: 🙂🚀🎉 👩‍👩‍👧 🇫🇷 and a flag 🏳️‍🌈, done.",
]
# letters that byte-level BPE splits over several tokens, mixed with plain ASCII
ALPHABET = "abc XYZ 123.,\néèçàœßäöüÄÖÜ€中国菜東京日本語ひらがな한국어🙂🚀🎉👩‍👧🇫🇷"


def _stream(tok, prompt: list[int], ids: list[int]) -> list[str]:
    d = Detokenizer(tok, prompt)
    deltas = [d.push(t) for t in ids]
    deltas.append(d.flush())
    assert d.text == "".join(deltas)
    return deltas


def test_multilingual_samples_stream_whole_characters(target_native) -> None:
    tok = target_native.tok
    prompt = tok.encode("Translate:")
    for text in SAMPLES:
        ids = tok.encode(text)
        deltas = _stream(tok, prompt, ids)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any(REPLACEMENT in d for d in deltas), deltas
    # the samples do split characters across tokens, or the test would prove nothing
    zh = tok.encode(SAMPLES[2])
    assert any(REPLACEMENT in tok.decode([t]) for t in zh)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=60), cut=st.integers(0, 60))
def test_any_prefix_streams_to_the_full_decode(target_native, text: str, cut: int) -> None:
    """Stopping anywhere (max_tokens inside a character) still yields exactly decode(prefix)."""
    tok = target_native.tok
    ids = tok.encode(text)[:cut] or tok.encode(text)
    deltas = _stream(tok, tok.encode("Q:"), ids)
    assert "".join(deltas) == tok.decode(ids)
    # only the final flush may carry an incomplete character
    assert not any(REPLACEMENT in d for d in deltas[:-1])
