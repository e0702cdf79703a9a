//! glibc takes the heap's thresholds ([`ferry_sidecar::heap`]). A test binary of its own: the
//! call must come before other threads allocate, and this process runs this one test alone.

#[test]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_takes_both_thresholds() {
    // A threshold above glibc's limit would be refused, leaving its defaults in place.
    assert!(ferry_sidecar::heap::keep_freed_memory());
}
