#![no_main]

// The properties live in fuzz-checks (see its crate doc), shared with the stable test.
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_checks::headers::check(data));
