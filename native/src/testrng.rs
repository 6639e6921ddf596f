//! The tests' seeded pseudo-random numbers (xorshift64): the same sequence on every run, no crate.

/// Successive values of xorshift64 from `seed` (nonzero).
pub(crate) fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// Values below `n` from `xorshift(seed)`.
pub(crate) fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut next = xorshift(seed);
    move |n| next() % n
}
