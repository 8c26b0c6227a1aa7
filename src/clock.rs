//! Clocks every layer reads (the VQPs' pre-checks, the links' idle
//! times, the datagram tier's timers).

/// `CLOCK_MONOTONIC_COARSE` in milliseconds: the pre-checks look at the
/// time once per one-sided WR. This clock is read from the vDSO's data page
/// without a clock source, so it is never a system call; `Instant::now` is
/// one wherever the clock source has no vDSO mode (virtual machines without
/// a stable TSC, such as the testbed), 6% of a READ's cost there.
pub fn coarse_ms() -> u64 {
    // SAFETY: a plain C struct.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid timespec; this clock exists on every Linux since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}
