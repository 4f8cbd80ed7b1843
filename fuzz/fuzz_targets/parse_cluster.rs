//! Feeds arbitrary bytes to the cluster readers, TOML descriptions and preset strings
//! (`dgx-h100:nodes=N`): each must return `Ok` or `Err` without panicking, and an accepted
//! cluster must write TOML that reads back to it and answer device questions.

#![no_main]

use autopar_cost_model::Cluster;
use libfuzzer_sys::fuzz_target;

fn exercise(c: &Cluster) {
    let n = c.num_devices();
    for device in [0, n / 2, n.saturating_sub(1)] {
        let _ = c.node_of(device);
        let _ = c.nic_of(device);
    }
    let again = Cluster::from_toml(&c.to_toml()).expect("written TOML reads back");
    assert_eq!(&again, c);
}

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = Cluster::from_toml(src) {
        exercise(&c);
    }
    if src.len() < 256
        && let Ok(c) = Cluster::preset(src)
    {
        exercise(&c);
    }
});
