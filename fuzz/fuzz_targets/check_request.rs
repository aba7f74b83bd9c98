//! `quotalease.v1.RateLimiter/Check` requests through the real handler (an
//! agent over an in-process allocator): an answer or UNAVAILABLE, never a
//! panic. Body: `quotalease_sim::fuzzing::check_request`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| quotalease_sim::fuzzing::check_request(data));
