"""anelm.generate.chat: a conversation's History fitted to the context, and the caches that carry
prompts from one request to the next (reusable, PromptCache)."""

from types import SimpleNamespace

import pytest

from anelm.generate.chat import History, PromptCache, reply_room, reusable
from anelm.models.errors import InputError


class WordsTok:
    """A chat template that writes each message's words ("w12" is id 12), nothing else."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [int(w[1:]) for m in messages for w in m["content"].split()]


def words(a, b):
    return " ".join(f"w{i}" for i in range(a, b))


def test_history_drops_the_oldest_turns_and_keeps_the_system_message():
    h = History(WordsTok(), "w1 w2", context=25, room=4)
    assert h.ask(words(10, 20)) == [1, 2] + list(range(10, 20)) and h.dropped == 0
    h.answer("w3 w4")
    assert h.ask(words(20, 30)) == [1, 2] + list(range(20, 30)) and h.dropped == 2  # 2 + 10 + 2 + 10 + 4 > 25
    assert h.turns[0]["content"] == words(20, 30)
    assert h.ask("   ") is None and h.dropped == 0  # a blank line asks nothing


def test_history_refuses_what_cannot_fit_and_withdraws():
    h = History(WordsTok(), None, context=20, room=4)
    with pytest.raises(InputError, match="the message was not sent: it makes a prompt of 17 tokens, and with "
                                         "room for a 4-token reply the context holds 20"):
        h.ask(words(10, 27))
    assert h.ask("w5") == [5]
    h.withdraw()
    assert h.turns == []
    with pytest.raises(InputError, match="the system message makes a prompt of 18 tokens; with room for a "
                                         "4-token reply it does not fit the context of 20"):
        History(WordsTok(), words(10, 28), context=20, room=4)
    assert (reply_room(128, 64), reply_room(8, 64)) == (32, 8)


def test_reusable_is_the_common_prefix_short_of_the_last_token():
    assert reusable([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert reusable([1, 2, 3, 4], [1, 2, 3, 4]) == 3  # the last token must run for its logits
    assert reusable([1, 2, 9], [1, 2, 3, 4]) == 2
    assert reusable([], [1, 2]) == 0 and reusable([1], [1]) == 0


class Runner:
    def __init__(self):
        self.made = 0

    def new_cache(self):
        self.made += 1
        return SimpleNamespace(length=0, capacity=64, name=f"cache{self.made}")


def served(store, prompt, generated):
    """One request: take a cache, "run" the prompt and all but the last generated token, put it back."""
    cache, reused = store.take(prompt)
    cache.length = len(prompt) + len(generated) - 1
    store.put(list(prompt) + list(generated), cache)
    return cache.name, reused


SYSTEM = [1, 2, 3, 4]


def test_a_second_turn_reuses_the_conversation_so_far():
    runner = Runner()
    store = PromptCache(runner)
    first = SYSTEM + [10, 11]
    assert served(store, first, [20, 21, 22]) == ("cache1", 0)
    second = first + [20, 21, 22, 12]  # the reply, then the next user message
    assert served(store, second, [30]) == ("cache1", len(first) + 2)  # all the cache held
    other = [7, 8]  # another conversation: a cache of its own while the store has room
    assert served(store, other, [50, 51]) == ("cache2", 0) and len(store) == 2
    # the longest shared prefix wins: the third turn, then a new conversation on the same system prompt
    third = second + [30, 13]
    assert served(store, third, [31]) == ("cache1", len(second))  # its reply's last token never ran
    assert served(store, SYSTEM + [40], [41]) == ("cache1", len(SYSTEM)) and runner.made == 2


def test_a_diverging_prompt_reuses_only_the_common_prefix():
    store = PromptCache(Runner())
    served(store, SYSTEM + [10, 11, 12], [20, 21])
    cache, reused = store.take(SYSTEM + [10, 99, 98])
    assert reused == len(SYSTEM) + 1 and cache.length == reused and len(store) == 0  # the taker owns it
    store.put(SYSTEM + [10, 99, 98], cache)
    assert store.entries[0][0] == tuple(SYSTEM + [10])  # what the cache holds: the reused prefix only


def test_the_least_recently_used_goes_first_and_a_full_store_recycles():
    runner = Runner()
    store = PromptCache(runner, max_entries=2)
    served(store, [1, 2, 3], [4])  # cache1
    served(store, [5, 6, 7], [8])  # cache2
    assert served(store, [1, 2, 3, 4, 9], [10]) == ("cache1", 3)  # cache1 is now the most recent
    # a prompt that shares nothing with a full store takes its oldest cache, emptied
    assert served(store, [40, 41], [42]) == ("cache2", 0) and runner.made == 2
    assert [held for held, _ in store.entries] == [(1, 2, 3, 4, 9), (40, 41)]
    cache = runner.new_cache()
    cache.length = 2
    store.put([60, 61, 62], cache)  # a third entry: the least recently used (cache1's) goes
    assert [held for held, _ in store.entries] == [(40, 41), (60, 61)]
