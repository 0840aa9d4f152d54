#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fusedev::fuzz::check_decode(data));
