//! Envoy `ShouldRateLimit` requests through the real handler (an agent over
//! an in-process allocator): per-descriptor statuses and a consistent
//! overall code, or INVALID_ARGUMENT naming a field, never a panic. Body:
//! `quotalease_sim::fuzzing::should_rate_limit`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| quotalease_sim::fuzzing::should_rate_limit(data));
