"""Every pair of nodes once, in rounds of disjoint pairs (the circle method): doctor.yml measures
each round's pairs at the same time, iperf3 between the nodes and an all-reduce between one rank of
each (train.allreduce --pairs). n nodes take n-1 rounds (n even) or n (n odd, one node idle per
round)."""


def pair_rounds(n):
    """[[(i, j), ...] per round] over node indexes 0..n-1, i < j in each pair."""
    slots = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(slots) - 1):
        half = len(slots) // 2
        pairs = [(slots[k], slots[-1 - k]) for k in range(half)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        slots = [slots[0], slots[-1]] + slots[1:-1]  # rotate all but the first
    return rounds
