"""Made-up engine records that several chapters' exercise contexts share: a memory budget and step records."""

from workbench.labs.ch02_fragmentation_live import reference_fragmentation_rate


def _step(**kw):
    base = dict(
        step=0,
        num_blocks=4,
        block_size=4,
        token_states=6,
        reservation=2,
        internal_fragmentation=1,
        external_fragmentation=3,
        free=4,
        kv_bytes_per_token=10,
        swap_out_blocks=0,
        swap_in_blocks=0,
    )
    base.update(kw)
    base["fragmentation_rate"] = reference_fragmentation_rate(base)
    return base


MEMORY = {
    "num_blocks": 1804,
    "block_size": 16,
    "kv_pool_tokens": 1804 * 16,
    "kv_pool_bytes": 1804 * 16 * 46080,
    "kv_budget_bytes": 1804 * 16 * 46080 + 1000,
    "block_bytes": 16 * 46080,
}
STEPS = [_step(), _step(step=1, reservation=0, free=6, swap_out_blocks=2), _step(step=2, swap_in_blocks=2)]
