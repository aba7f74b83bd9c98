//! Arrival generation cost: one simulated second of the hot-tenant mix
//! (about 1 M checks over 300 agents), filled in 1 ms windows as the event
//! loop does. Criterion reports time per arrival (throughput in elements).
//!
//! `CARGO_TARGET_DIR=... cargo bench -p quotalease-sim --bench workload`

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use quotalease_sim::rng::SimRng;
use quotalease_sim::workload::{Arrival, Workload, WorkloadSpec};

fn specs() -> Vec<WorkloadSpec> {
    quotalease_sim::scenario::from_yaml(
        "- { kind: hot, tenant: 0, rps: 30000 }\n\
         - { kind: zipf, tenants: 100000, s: 1.0, rps: 970000 }\n",
    )
    .expect("bench specs parse")
}

fn one_second(w: &Workload, out: &mut Vec<Arrival>) -> usize {
    // Cloning copies the prebuilt Zipf table (0.8 MB): not counted as
    // generation, but it is in the figure, so the figure is an upper bound.
    let mut w = w.clone();
    let mut n = 0;
    for ms in 0..1000u64 {
        out.clear();
        w.fill(ms * 1_000_000, (ms + 1) * 1_000_000, out);
        n += out.len();
    }
    n
}

fn bench(c: &mut Criterion) {
    let w = Workload::new(&specs(), 300, SimRng::new(1));
    let mut out = Vec::with_capacity(4096);
    let n = one_second(&w, &mut out);
    let mut g = c.benchmark_group("workload");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("hot+zipf100k_1s_300_agents", |b| {
        b.iter(|| black_box(one_second(&w, &mut out)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
