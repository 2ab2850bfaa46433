"""One known-answer test per term of the eviction policies' priorities (issue 39): each test is built so that the
answer changes when its term is dropped (checked by deleting the term and seeing the test fail). The sequences are
hand-made so that the policy's tie-break (the smaller key) would pick the other victim: a test that a term's
absence leaves passing by the tie-break alone would not pin the term."""

from fate_edge.runtime.cache import ARC, LCU, LFU, AccessInfo, DecayedPopularity, ExpertCache, NextUse, NextUseConfig

L = 8  # decoder layers in the LCU sequences


def passes(lcu: LCU, calls: list[list[tuple[int, int, bool]]], now: int) -> None:
    """Feed ``calls``: per past forward pass, the (layer, expert, low_precision) uses in layer order, then open the
    current pass up to layer ``now``. Filler experts (0, 15) and (L-1, 15) open and close every pass, so each pass
    wraps to layer 0 as in decode (the fillers are never candidates)."""
    for call in calls:
        for layer, expert, low in [(0, 15, False), *call, (L - 1, 15, False)]:
            lcu.on_access((layer, expert), False, AccessInfo(layer_now=layer, num_layers=L, low_precision=low))
    for layer in sorted({0, now}):
        lcu.on_access((layer, 14), False, AccessInfo(layer_now=layer, num_layers=L))


# --- LCU (MoE-APEX): p = (H + r·Lo)/T, + 1/D when used in the previous pass -----------------------------------


def test_lcu_counts_high_precision_uses():
    """(1, 1) was used once in high precision, (1, 2) never: the unused one goes, though the tie-break would
    pick (1, 1)."""
    lcu = LCU()
    passes(lcu, [[(1, 1, False)], [], []], now=3)
    assert lcu.victim([(1, 1), (1, 2)]) == (1, 2)


def test_lcu_counts_low_precision_uses():
    """The same with a low-precision use: it still counts (at b_low/b_high)."""
    lcu = LCU()
    passes(lcu, [[(1, 1, True)], [], []], now=3)
    assert lcu.victim([(1, 1), (1, 2)]) == (1, 2)


def test_lcu_weighs_low_precision_uses_by_the_byte_ratio():
    """Three low-precision uses at ratio 0.5 cost 1.5, less than two high-precision uses: (1, 1) goes. Weighed as
    high-precision uses they would cost 3 and (1, 2) would go."""
    lcu = LCU(low_high_ratio=0.5)
    passes(lcu, [[(1, 1, True)], [(1, 1, True), (2, 2, False)], [(1, 1, True), (2, 2, False)], []], now=3)
    assert lcu.victim([(1, 1), (2, 2)]) == (1, 1)


def test_lcu_normalises_counts_by_forward_passes():
    """(1, 0) was used in 9 of the first 9 passes but not the last one; (5, 0) only in the last one, and it is
    1 layer ahead of the layer being computed (4). Normalised, (1, 0) costs 9/11 and (5, 0) 1/11 + 1/1.1: the
    often-used one goes, as MoE-APEX's priority says. Unnormalised counts (9 against 1 + 0.9) would keep it."""
    lcu = LCU()
    passes(lcu, [[(1, 0, False)]] * 9 + [[(5, 0, False)]], now=4)
    assert lcu.t == 10 and lcu.layer_now == 4
    assert lcu.victim([(1, 0), (5, 0)]) == (1, 0)


def test_lcu_distance_bonus_favours_the_nearest_layer_ahead():
    """Both used once, both in the previous pass; now at layer 6, layer 1 is 3 layers ahead (the next token's),
    layer 5 is 7 ahead: (5, 0) goes. Without the distance term the tie-break evicts (1, 0); with the distance
    measured backwards (l_now - l) it would too."""
    lcu = LCU()
    passes(lcu, [[(1, 0, False), (5, 0, False)]], now=6)
    assert lcu.victim([(1, 0), (5, 0)]) == (5, 0)


def test_lcu_distance_bonus_only_for_the_previous_pass():
    """(1, 0) was used two passes ago, (5, 0) in the previous pass, once each. Only (5, 0) gets the +1/D bonus, so
    (1, 0) goes, though it is nearer ahead (3 layers against 7): a bonus for every used expert would keep it."""
    lcu = LCU()
    passes(lcu, [[(1, 0, False)], [(5, 0, False)]], now=6)
    assert lcu.victim([(1, 0), (5, 0)]) == (1, 0)


def test_lcu_statistics_reset_per_sequence():
    """A new request forgets the last one's counts: (1, 1) was used three times in the previous sequence, (1, 2)
    once in this one; (1, 1) goes."""
    lcu = LCU()
    passes(lcu, [[(1, 1, False)]] * 3, now=0)
    lcu.new_sequence()
    passes(lcu, [[(1, 2, False)], []], now=3)
    assert lcu.victim([(1, 1), (1, 2)]) == (1, 1)


def test_lcu_evicts_by_distance_through_the_cache():
    """The distance term as the cache drives it (access, insert, evict on a full cache): two experts used once in
    the previous pass; at layer 6 the one 7 layers ahead is evicted for the newcomer, not the one 3 ahead."""
    lcu = LCU()
    cache = ExpertCache({0: 2}, lambda part, cap: lcu, entry_bytes=1, partition_of=lambda key: 0)
    for layer, e in [(1, 0), (5, 0)]:
        cache.access((layer, e), False, AccessInfo(layer_now=layer, num_layers=L))
        cache.insert((layer, e), object(), 1, 4)
    cache.access((0, 9), False, AccessInfo(layer_now=0, num_layers=L))  # new forward pass
    cache.access((6, 3), False, AccessInfo(layer_now=6, num_layers=L))
    assert cache.insert((6, 3), object(), 1, 4)
    assert (1, 0) in cache and (5, 0) not in cache


# --- ARC: the ghost lists move the target size p of T1 ---------------------------------------------------------


def arc_cache(arc: ARC, capacity: int) -> ExpertCache:
    return ExpertCache({0: capacity}, lambda part, cap: arc, entry_bytes=1, partition_of=lambda key: 0)


def replay(cache: ExpertCache, keys: list[int]) -> list[bool]:
    """Replay ``keys`` (experts of layer 0) through ``cache``: hit or miss per access, a miss inserted."""
    hits = []
    for k in keys:
        key = (0, k)
        hit = key in cache
        cache.access(key, hit, AccessInfo())
        if not hit:
            cache.insert(key, object(), 1, 4)
        hits.append(hit)
    return hits


def arc_run(arc: ARC, capacity: int, keys: list[int]) -> list[bool]:
    """Replay ``keys`` through a fresh cache of ``capacity`` entries driven by ``arc``."""
    return replay(arc_cache(arc, capacity), keys)


def test_arc_b1_ghost_hit_grows_t1_and_keeps_recent_keys():
    """1 and 2 are used twice (T2); 3 is evicted from T1 into ghost B1 by 4 and comes back: p grows by
    max(1, |B2|/|B1|) = 1. Newcomer 5 takes T2's LRU (1; T1 is empty); then 6 finds one key in T1 and p = 1, so
    it evicts from T2 again (2) and 5 is still there when it returns. With p left at 0, 6 would evict 5."""
    arc = ARC(3)
    cache = arc_cache(arc, 3)
    assert replay(cache, [1, 1, 2, 2, 3, 4, 3]) == [False, True, False, True, False, False, False]
    assert arc.p == 1.0 and (0, 3) in arc.t2  # a ghost hit was seen twice: it joins the frequency list
    assert replay(cache, [5, 6, 5]) == [False, False, True]


def test_arc_b2_ghost_hit_shrinks_t1_and_protects_frequent_keys():
    """Continuing the sequence above, 1 returns from ghost B2: p falls back to 0 (by max(1, |B1|/|B2|) = 1).
    Newcomer 7 takes T2's LRU (3; T1 is empty), then 8 finds 7 alone in T1 and p = 0: it evicts 7, and the
    frequent 5 is still there when it returns. With p left at 1, 8 would evict 5 from T2."""
    arc = ARC(3)
    hits = arc_run(arc, 3, [1, 1, 2, 2, 3, 4, 3, 5, 6, 5, 1, 7, 8, 5])
    assert arc.p == 0.0
    assert hits[-4:] == [False, False, False, True]


def test_arc_b2_ghost_hit_step_grows_with_b1():
    """The B2 step is max(1, |B1|/|B2|): two B1 ghosts and one B2 ghost move p by 2, from 3 to 1, and the
    returning key joins T2."""
    arc = ARC(3)
    arc.p = 3.0
    arc.t2.update({(0, 1): None})
    arc.b1.update({(0, 7): None, (0, 8): None})
    arc.b2.update({(0, 9): None})
    arc.on_insert((0, 9))
    assert arc.p == 1.0 and (0, 9) in arc.t2 and (0, 9) not in arc.b2


def test_arc_b1_ghost_hit_step_grows_with_b2():
    """The B1 step is max(1, |B2|/|B1|): with three B2 ghosts and one B1 ghost, p moves by 3."""
    arc = ARC(4)
    arc.b1.update({(0, 1): None})
    arc.b2.update({(0, 7): None, (0, 8): None, (0, 9): None})
    arc.on_insert((0, 1))
    assert arc.p == 3.0


def test_arc_evicts_from_t1_for_a_b2_ghost_when_t1_is_at_target():
    """Megiddo & Modha's REPLACE: a newcomer coming back from B2 takes T1's LRU when |T1| equals p exactly (here 1),
    where any other newcomer would take T2's LRU."""
    arc = ARC(3)
    arc.p = 1.0
    arc.t1.update({(0, 1): None})
    arc.t2.update({(0, 2): None, (0, 3): None})
    arc.b2.update({(0, 4): None})
    residents = [(0, 1), (0, 2), (0, 3)]
    assert arc.victim(residents, incoming=(0, 4)) == (0, 1)
    assert arc.victim(residents, incoming=(0, 5)) == (0, 2)


def test_arc_ghost_lists_hold_at_most_capacity():
    """Ghosts are bounded by the cache's capacity: a long scan through 2 slots leaves 2 ghosts, and only the most
    recently evicted keys (an old ghost no longer counts as one)."""
    arc = ARC(2)
    arc_run(arc, 2, list(range(10)))
    assert list(arc.b1) == [(0, 6), (0, 7)]


# --- Decayed popularity: score ← decay·score + 1 -----------------------------------------------------------------


def test_popularity_decays_old_uses():
    """(0, 1) was used 3 times long ago, (0, 2) twice just now: at decay 0.5, 3 uses 10 accesses back weigh
    3·0.5^10 < 2, and (0, 1) goes. Undecayed counts (3 against 2) would keep it."""
    pop = DecayedPopularity(decay=0.5)
    for key in [(0, 1)] * 3 + [(0, 3)] * 8 + [(0, 2)] * 2:
        pop.on_access(key, False, AccessInfo())
    assert pop.victim([(0, 1), (0, 2)]) == (0, 1)


# --- LFU: ties in count broken by recency --------------------------------------------------------------------------


def test_lfu_breaks_count_ties_by_recency():
    """2 then 1 used once each: the newcomer 3 evicts the older 2, though the tie-break by key would pick 1."""
    lfu = LFU()
    cache = ExpertCache({0: 2}, lambda part, cap: lfu, entry_bytes=1, partition_of=lambda key: 0)
    for k in (2, 1, 3):
        cache.access((0, k), False, AccessInfo())
        cache.insert((0, k), object(), 1, 4)
    assert set(cache.entries) == {(0, 1), (0, 3)}


# --- next-use: d + (1 - p_next) · L / p_token ---------------------------------------------------------------------


def tokens(nu: NextUse, calls: list[list[tuple[int, int]]], num_layers: int) -> None:
    """Feed ``calls``: per token, its (layer, expert) uses in layer order."""
    for call in calls:
        for layer, e in call:
            nu.on_access((layer, e), False, AccessInfo(layer_now=layer, num_layers=num_layers))


def test_next_use_decays_old_uses():
    """(0, 1) was used on 4 tokens long ago, (0, 2) on the 2 before last: at decay 0.5 the old uses count for
    almost nothing and (0, 1) is expected back later (the last call, (0, 4), has no learned transitions, so only
    the rates decide). Undecayed, 4 uses against 2 would keep it."""
    nu = NextUse(NextUseConfig(decay=0.5, bypass=False), num_experts=8)
    filler = (1, 7)
    tokens(nu, [[(0, 1), filler]] * 4 + [[(0, 3), filler]] * 5 + [[(0, 2), filler]] * 2 + [[(0, 4)]], 2)
    assert nu.p_token((0, 1)) < nu.p_token((0, 2))
    assert nu.victim([(0, 1), (0, 2)]) == (0, 1)


def test_next_use_counts_the_layers_to_the_next_call():
    """Two experts with the same statistics (used once, on the same token), at layers 1 and 3; now at layer 2,
    layer 3 comes next and layer 1 three layers later: (1, 0) goes. Without the distance they tie, and the
    tie-break would evict (3, 0)."""
    nu = NextUse(NextUseConfig(bypass=False), num_experts=8)
    tokens(nu, [[(0, 7), (1, 0), (3, 0)], [(0, 7), (1, 5), (3, 5)], [(0, 7), (2, 6)]], 4)
    assert nu.p_next((1, 0)) == nu.p_next((3, 0)) and nu.p_token((1, 0)) == nu.p_token((3, 0))
    assert nu.victim([(1, 0), (3, 0)]) == (1, 0)


def test_next_use_waits_for_a_rare_expert_in_tokens_at_its_rate():
    """Nothing used yet but (2, 5) now at layer 2 of 8. (2, 0) has a calibration share of 0.45, (3, 0) of 0.01:
    (3, 0) is a layer away but expected back only after ~53 tokens (1 / p_token of its layer's calls), (2, 0) after
    8 layers and a quarter token: (3, 0) goes. Counting a miss of the next call as one token's wait whatever the
    rate would evict (2, 0)."""
    nu = NextUse(NextUseConfig(bypass=False), seed_share={(2, 0): 0.45, (3, 0): 0.01}, num_experts=8)
    tokens(nu, [[(2, 5)]], 8)
    assert nu.victim([(2, 0), (3, 0)]) == (3, 0)


def test_next_use_statistics_reset_per_sequence():
    """A new request forgets the last one's uses: (0, 1) was used on 6 tokens of the previous request, (0, 2) on
    one token of this one; (0, 1) goes."""
    nu = NextUse(NextUseConfig(bypass=False), num_experts=8)
    tokens(nu, [[(0, 1), (1, 7)]] * 6, 2)
    nu.new_sequence()
    tokens(nu, [[(0, 2), (1, 7)], [(0, 3)]], 2)
    assert nu.victim([(0, 1), (0, 2)]) == (0, 1)
