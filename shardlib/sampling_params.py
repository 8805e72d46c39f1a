"""What one request asks of token selection (greedy, temperature, top-k, top-p, min-p, a seed,
penalties, a logit bias, allowed token ids, bad words, structured output), checked when it is built. Pure: the
driver, the CLI and the Serve front end build and check these without
importing torch (about 2 s of every `corelaunch` command's and Serve replica's start); the ranks'
sampling itself is workers/sampling.py."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardlib.config_fields import finite
from shardlib.positive_int import integer_of_any_kind, real_of_any_kind
from shardlib.structured_output import StructuredOutput

MAX_BAD_WORDS = 128
"""bad_words holds at most this many words (vLLM bounds none): each is tokenized twice per request, and
its sequences are matched against the output at every step on the group's leader."""
MAX_BAD_WORD_CHARS = 200
"""A bad word is at most this many characters: a longer one is a passage, whose ban needs its whole
token sequence generated first (and matching it costs every step)."""

MIN_SEED, MAX_SEED = -2**63, 2**63 - 1
"""A seed is any signed 64-bit integer, as OpenAI's API takes it (torch reads a negative one modulo 2**64)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy. The sampling table holds temperatures in float32, where the
tiniest round to 0 (the row sampled at temperature 1) or stay as denormals that divide the logits
into infinities (NaN probabilities: the draw raised); this close to 0, sampling picks the argmax
anyway."""

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2], as OpenAI's API (and vLLM) bound them."""

MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in [-100, 100], as OpenAI's API bounds it (-100 all but bans a token, 100 all
but forces it)."""

MIN_REPETITION_PENALTY = 1.1754943508222875e-38
"""float32's smallest normal value: the ranks apply repetition_penalty in float32, where a smaller
one is a denormal or 0 (0 / 0 is NaN), as a larger one than MAX_TEMPERATURE is infinite (0 * inf)."""

MAX_TEMPERATURE = 3.4028234663852886e38
"""float32's largest value: the sampling table holds temperatures in float32, where a larger one is
infinity, every scaled logit 0, and top-k and top-p keep tokens by id instead of by likelihood."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None
    """Divides the logits before softmax; 0 (or anything below GREEDY_BELOW) means greedy (argmax),
    ignoring top_k, top_p and min_p. None (not given): 1.0 where top_k, top_p or min_p asks for sampling, else 0
    (greedy), as `corelaunch generate` reads its flags; a seed alone is refused (greedy takes none)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 means no limit (as does any k at least the vocabulary)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p; 1 keeps all."""
    seed: int | None = None
    """Seed of this request's generator; the same seed gives the same tokens. None: unseeded."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token generated so far (OpenAI's; in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far (OpenAI's; in [-2, 2])."""
    repetition_penalty: float = 1.0
    """transformers' and vLLM's: every token of the prompt or the output so far has its logit divided
    by this when positive, multiplied when not; 1 is off, above 1 discourages repeats (workers/penalties.py)."""
    min_p: float = 0.0
    """Keep only tokens at least min_p times as likely as the most likely one (transformers' and
    vLLM's; in [0, 1]; 0 is off). Where top_k or top_p asks nothing, it alone asks for sampling."""
    min_tokens: int = 0
    """Tokens generated before a stop token (EOS included) may end the request (vLLM's name, with the
    meaning of transformers' min_new_tokens): until then the stop tokens' logits are -inf. At most the
    request's max_new_tokens (shardlib/request_checks.py). Stop strings are held back too, as vLLM
    holds them: a stop string counts only where it ends in the text of the tokens after the first
    min_tokens (the driver's text stream, launcher/serving/text_stream.py)."""
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    """Added to these tokens' logits before penalties and sampling, greedy included (OpenAI's):
    {token_id: bias}, each bias in [-100, 100]. Kept as a tuple of (token_id, bias) pairs in id
    order (the params stay hashable); token ids are checked against the vocabulary with the
    request (shardlib/request_checks.py)."""
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    """Only these token ids may be chosen, at every step, greedy included (vLLM's): every other
    logit is -inf before logit_bias, penalties and sampling. None: every token. A non-empty list of
    ids >= 0 (duplicates merged; kept as a sorted tuple, AllowedIds, the params stay hashable); checked against
    the vocabulary with the request (shardlib/request_checks.py). With no stop token (EOS included)
    among them, the request runs to its max tokens; with structured output, only ids both allow."""
    bad_words: tuple[str, ...] | list[str] = ()
    """Words never generated (vLLM's): each is tokenized without special tokens as given and with a
    leading space; a word of one token bans that token at every step, a longer one bans its last token
    right after the output (not the prompt) ends with the tokens before it. At most MAX_BAD_WORDS
    non-empty strings of at most MAX_BAD_WORD_CHARS characters each (kept as a tuple). The driver API
    tokenizes them (bad_words_token_ids) before the request is submitted."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] | list = field(default=(), repr=False)
    """bad_words' token sequences, filled by the driver (launcher/api.py, which has the tokenizer)
    with vLLM's rule; what the ranks ban (workers/penalties.py). Not set by users: the driver
    replaces it from bad_words on every request."""
    structured_output: StructuredOutput | None = None
    """What the output must match (shardlib/structured_output.py): at each step the group's leader
    allows only the tokens that keep the output a prefix of a match (after penalties and bias), and
    ends the request ("stop") once the output is a whole match that cannot go on."""

    def __post_init__(self) -> None:
        _plain_numbers(self)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output={self.structured_output!r} must be a StructuredOutput (or None)")
        k = self.top_k
        if type(k) is int and k == -1:  # vLLM's "every token", long its default: code ported from it sends it
            object.__setattr__(self, "top_k", k := 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k={k!r} must be an integer >= 0 (0, or -1 as vLLM writes it, turns top-k off)")
        p = self.top_p
        if not _number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} must be a number in (0, 1] (1 turns top-p off)")
        s = self.seed
        if type(s) is int and s == -1:  # vLLM's "no seed": code ported from it sends it (a derived
            object.__setattr__(self, "seed", s := None)  # choice seed of -1 is set past this check)
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not MIN_SEED <= s <= MAX_SEED):
            raise ValueError(f"seed={s!r} must be None or an integer in [-2**63, 2**63 - 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}={value!r} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] "
                                 f"(0 turns it off)")
        r = self.repetition_penalty
        if not _number(r) or not finite(r) or r <= 0:
            raise ValueError(f"repetition_penalty={r!r} must be a finite number > 0 (1 turns it off; above 1 "
                             f"discourages repeating the prompt's and the output's tokens)")
        if not MIN_REPETITION_PENALTY <= r <= MAX_TEMPERATURE:
            raise ValueError(f"repetition_penalty={r!r} must be in [{MIN_REPETITION_PENALTY:.7g}, "
                             f"{MAX_TEMPERATURE:.7g}] (float32's normal range, in which the ranks apply it: "
                             f"past it the penalty is 0 or infinite, and a logit of 0 becomes NaN)")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _allowed_ids(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", _bad_word_sequences(self.bad_words_token_ids))
        n = self.min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"min_tokens={n!r} must be an integer >= 0 (0 lets a stop token end the request at once)")
        m = self.min_p
        if not _number(m) or not 0 <= m <= 1:
            raise ValueError(f"min_p={m!r} must be a number in [0, 1] (0 turns min-p off)")
        if self.temperature is None:
            # top_k=50 alone was greedy without a word: sampling asked for is sampling at temperature 1
            sampling = k > 0 or p < 1 or m > 0
            if not sampling and s is not None:
                raise ValueError(f"seed={s!r} seeds sampling, and nothing asks for sampling (the default is greedy, "
                                 f"which takes no seed): give a temperature, or top_k / top_p / min_p (which sample "
                                 f"at temperature 1)")
            object.__setattr__(self, "temperature", 1.0 if sampling else 0.0)
        t = self.temperature
        if not _number(t) or not finite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
        if t > MAX_TEMPERATURE:
            raise ValueError(f"temperature={t!r} must be at most {MAX_TEMPERATURE:.7g} (float32's largest value, in "
                             f"which the ranks scale the logits; any temperature this high samples all but uniformly)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def adjusts_logits(self, generated: int) -> bool:
        """Whether the logits change before the token choice of a request that has generated
        `generated` tokens (workers/penalties.py): allowed token ids, bad words, penalties, a logit
        bias, or stop tokens still held back by min_tokens (past it, a request asking nothing else
        costs the step nothing)."""
        return (self.allowed_token_ids is not None or bool(self.bad_words_token_ids) or bool(self.logit_bias)
                or self.has_penalties or self.min_tokens > generated)

    def with_derived(self, **fields) -> "SamplingParams":
        """A copy with `fields` set and nothing checked again: for values the caller derived from
        checked ones (a choice's seed, the tokenizer's ids of the bad words). dataclasses.replace
        checks every field anew: 262144 allowed_token_ids sorted again per choice, on the server's
        event loop. The copy shares the checked fields (allowed_token_ids' set, hence the leader's
        mask for it)."""
        copied = copy.copy(self)
        for name, value in fields.items():
            object.__setattr__(copied, name, value)  # frozen: set as __post_init__ sets its own
        return copied


class AllowedIds(tuple):
    """allowed_token_ids as SamplingParams keeps them: a tuple of sorted distinct ids, whose hash is
    computed once. The leader finds a request's mask by its set at every decode step
    (workers/penalties.py), and Python hashes a plain tuple anew each time: 0.64 ms a step for
    262144 ids. `mask_entry` is the leader's: its mask cache's entry for this set, kept with the set
    so that the next step need not look the set up again (a request sending the same set as another
    compares the two once, not at every step). Pickled as the plain ids (neither the hash nor the
    entry travels), made again on the other side, hash included."""

    def __new__(cls, ids=()):
        allowed = super().__new__(cls, ids)
        allowed._hash = tuple.__hash__(allowed)
        allowed.mask_entry = None
        return allowed

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return AllowedIds, (tuple(self),)


def no_token_left(allowed: tuple[int, ...], held) -> bool:
    """Whether every one of the (distinct) allowed token ids is among the held-back ones. As cheap
    as len() where the allowed ids outnumber the held ones (none held: always): the leader asks at
    every step."""
    return len(allowed) <= len(held) and all(token in held for token in allowed)


def check_allowed_beyond_stops(params, ending_ids) -> None:
    """ValueError naming the first SamplingParams whose allowed_token_ids are each removed from its
    first step on: banned by a bad word of one token (bad_words_token_ids, banned at every step), or
    an ending id (stop tokens, EOS included) while min_tokens holds those back. No first token could
    be chosen. Checked before submitting, once the driver has tokenized the bad words: the leader
    would fail the request in its first step, and a static batch as a whole. (A longer bad word bans
    its last token only after its other tokens: the leader refuses the step that leaves nothing.)"""
    ending = set(ending_ids)
    for p in params:
        allowed = getattr(p, "allowed_token_ids", None)
        if not allowed:
            continue
        held = ending if p.min_tokens > 0 else set()
        banned = {seq[0] for seq in getattr(p, "bad_words_token_ids", ()) if len(seq) == 1}
        if no_token_left(allowed, held.union(banned) if banned else held):
            raise ValueError(_nothing_allowed_left(p, held, banned))


def _nothing_allowed_left(p, held: set[int], banned: set[int]) -> str:
    """Why check_allowed_beyond_stops refuses p, naming the fields that leave no allowed token."""
    allowed = p.allowed_token_ids
    shown = list(allowed[:5])
    if no_token_left(allowed, held):
        return (f"allowed_token_ids {shown} are all stop tokens (EOS included), which min_tokens ({p.min_tokens}) "
                f"holds back: no token could be chosen; allow other tokens too, or lower min_tokens")
    words = (f"bad_words (whose words of one token ban token ids {sorted(banned.intersection(allowed))[:5]} at "
             f"every step)")
    if no_token_left(allowed, banned):
        return (f"allowed_token_ids {shown} are all banned by {words}: no token could be chosen; allow other "
                f"tokens too, or remove those bad words")
    return (f"allowed_token_ids {shown} are each banned by {words} or a stop token (EOS included), which min_tokens "
            f"({p.min_tokens}) holds back: no token could be chosen; allow other tokens too, remove those bad words, "
            f"or lower min_tokens")


def _allowed_ids(ids) -> AllowedIds:
    """allowed_token_ids as checked ids, duplicates merged, in id order. An empty list is refused as
    vLLM refuses it: it would leave no token to choose."""
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"allowed_token_ids={ids!r} must be a non-empty list of token ids (or None for every token)")
    ids = list(ids)
    if not ids:
        raise ValueError("allowed_token_ids=[] must be a non-empty list of token ids: an empty one leaves no token "
                         "to choose (leave it out, or None, for every token)")
    checked = [integer_of_any_kind(token) for token in ids]
    bad = [token for token, number in zip(ids, checked) if number is None or number < 0]
    if bad:
        raise ValueError(f"allowed_token_ids holds {bad[:5]!r}, which are not token ids; they must be "
                         f"integers >= 0")
    return AllowedIds(sorted(set(checked)))


def _bad_words(words) -> tuple[str, ...]:
    """bad_words as a tuple of checked strings (order kept, duplicates kept: they ban the same)."""
    if isinstance(words, (str, bytes, Mapping)) or not hasattr(words, "__iter__"):
        raise ValueError(f"bad_words={words!r} must be a list of strings (words never to generate), or () for none")
    words = tuple(words)
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words holds {len(words)} words; at most {MAX_BAD_WORDS} are allowed")
    for i, word in enumerate(words):
        if not isinstance(word, str):
            raise ValueError(f"bad_words[{i}]={word!r} must be a string")
        if not word.strip():  # vLLM strips a word's leading spaces: nothing would be left to ban
            raise ValueError(f"bad_words[{i}]={word!r} must be a non-empty word (not only spaces)")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words[{i}] ({word[:20]!r}..., {len(word)} characters) must be at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
    return words


def _bad_word_sequences(sequences) -> tuple[tuple[int, ...], ...]:
    """bad_words_token_ids as a tuple of non-empty token-id tuples (ids >= 0)."""
    if isinstance(sequences, (str, bytes, Mapping)) or not hasattr(sequences, "__iter__"):
        raise ValueError(f"bad_words_token_ids={sequences!r} must be a list of token-id lists")
    checked = []
    for sequence in sequences:
        ids = [integer_of_any_kind(token) for token in sequence] if hasattr(sequence, "__iter__") else []
        if not ids or any(token is None or token < 0 for token in ids):
            raise ValueError(f"bad_words_token_ids holds {sequence!r}, which is not a non-empty list of token ids "
                             f"(integers >= 0)")
        checked.append(tuple(ids))
    return tuple(checked)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias given as {token_id: bias} (or (token_id, bias) pairs) as checked pairs in id order."""
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (tuple, list)) and all(isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in bias):
        items = [tuple(pair) for pair in bias]
    else:
        raise ValueError(f"logit_bias={bias!r} must be a mapping {{token_id: bias}} (or (token_id, bias) pairs)")
    pairs = {}
    for token, value in items:
        token_id, number = integer_of_any_kind(token), real_of_any_kind(value)
        if token_id is None or token_id < 0:
            raise ValueError(f"logit_bias names {token!r}, which is not a token id; its keys must be integers >= 0")
        if number is None or not finite(number) or not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token_id}]={value!r} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]")
        if token_id in pairs:
            raise ValueError(f"logit_bias names token {token_id} twice; give each token one bias")
        pairs[token_id] = float(number)
    return tuple(sorted(pairs.items()))


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _plain_numbers(params: SamplingParams) -> None:
    """numpy's scalars (np.int64 top_k, np.float32 temperature) and torch's 0-d tensors as Python's
    int and float, as prompts take them: checked like any other value, and plain on the ranks."""
    for name in ("top_k", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "min_tokens"):
        value = getattr(params, name)
        if type(value) in (int, float, bool) or value is None:
            continue
        number = integer_of_any_kind(value) if name in ("top_k", "seed", "min_tokens") else real_of_any_kind(value)
        if number is not None:
            object.__setattr__(params, name, number)
