//! The quality figures of SPEC §2 — false rejects, utilization, fairness —
//! as functions of recorded decisions. They know nothing of the simulator:
//! the event loop feeds each tracked key's `(time, cost, admitted)` to the
//! streaming forms ([`FalseRejectStream`], [`UtilizationStream`]) as the
//! run goes, in memory bounded by a round trip's worth of requests; the
//! slice forms ([`false_rejects`], [`utilization`]) feed the same code.

use quotalease_model::rules::Rate;

/// Result of [`false_rejects`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FalseRejects {
    /// Requests we denied.
    pub denied: u64,
    /// Of those, the ones an ideal global bucket would have admitted under
    /// every shift of the arrivals (see [`false_rejects`]).
    pub false_denied: u64,
    /// All requests.
    pub requests: u64,
}

impl FalseRejects {
    /// `false_denied / requests` (0 with no requests).
    pub fn ratio(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.false_denied as f64 / self.requests as f64
        }
    }
}

/// Counts our false denials of one key (SPEC §2: "a denial is false if an
/// ideal single global bucket would have admitted it under every shift of
/// the arrivals by up to one regional round trip").
///
/// `requests` are `(t_ns, cost, admitted)` in any order; `shift_ns` is one
/// regional round trip. This sorts them by time (ties in input order) and
/// feeds them to a [`FalseRejectStream`], which says what is counted.
pub fn false_rejects(
    requests: &[(u64, u64, bool)],
    rate: Rate,
    burst: u64,
    shift_ns: u64,
) -> FalseRejects {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests[i].0); // stable: ties in input order
    let mut s = FalseRejectStream::new(rate, burst, shift_ns);
    for i in order {
        let (t, c, admitted) = requests[i];
        s.push(t, c, admitted);
    }
    s.finish()
}

/// The quality figures of one tracked key, computed as the run goes:
/// false rejects ([`FalseRejectStream`]) over every request and
/// utilization ([`UtilizationStream`]) over every admission.
#[derive(Clone, Debug)]
pub struct KeyQuality {
    false_rejects: FalseRejectStream,
    utilization: UtilizationStream,
    rate: Rate,
}

impl KeyQuality {
    /// For a key with `rate` and `burst`: false rejects under shifts of
    /// `shift_ns`, utilization over windows of `window_ns` inside
    /// `[from_ns, to_ns)`.
    pub fn new(
        rate: Rate,
        burst: u64,
        shift_ns: u64,
        from_ns: u64,
        to_ns: u64,
        window_ns: u64,
    ) -> Self {
        Self {
            false_rejects: FalseRejectStream::new(rate, burst, shift_ns),
            utilization: UtilizationStream::new(from_ns, to_ns, window_ns),
            rate,
        }
    }

    /// One request at `t` (not before the previous one).
    pub fn push(&mut self, t: u64, cost: u64, admitted: bool) {
        self.false_rejects.push(t, cost, admitted);
        if admitted {
            self.utilization.push(t, cost);
        }
    }

    /// End of the run: decide the requests still open.
    pub fn finish(&mut self) {
        self.false_rejects.finish();
    }

    /// False rejects (of the requests decided: all of them after
    /// [`KeyQuality::finish`]).
    pub fn false_rejects(&self) -> FalseRejects {
        self.false_rejects.so_far()
    }

    /// Shortfall (SPEC §2): tokens we admitted / tokens one ideal global
    /// bucket admits over the same arrivals (NaN if it admits none).
    pub fn versus_ideal(&self) -> f64 {
        let (ours, ideal) = self.versus_ideal_tokens();
        if ideal == 0 {
            f64::NAN
        } else {
            ours as f64 / ideal as f64
        }
    }

    /// Tokens we admitted and tokens one ideal global bucket admitted over
    /// the same arrivals.
    pub fn versus_ideal_tokens(&self) -> (u64, u64) {
        self.false_rejects.versus_ideal()
    }

    /// Per whole second: requests we denied and of those the false ones
    /// ([`FalseRejectStream::per_second`]).
    pub fn denials_per_second(&self) -> &[(u64, u64)] {
        self.false_rejects.per_second()
    }

    /// Tokens admitted and tokens one ideal bucket admitted, per second
    /// ([`FalseRejectStream::tokens_per_second`]).
    pub fn tokens_per_second(&self) -> &[(u64, u64)] {
        self.false_rejects.tokens_per_second()
    }

    /// Utilization per window.
    pub fn utilization(&self) -> Vec<f64> {
        self.utilization.ratios(self.rate)
    }
}

/// One request as the ideal bucket saw it (48 bytes: a cold key keeps
/// two of them).
#[derive(Clone, Copy, Debug)]
struct Ideal {
    t: u64,
    /// The ideal bucket's level after its own decision (fine units).
    level: u128,
    cost: u64,
    /// Our decision.
    admitted: bool,
    /// The ideal bucket's: it charged `cost` (in fine units) for it.
    charged: bool,
}

/// The false-reject count of [`false_rejects`], fed one request at a time
/// in time order and kept in memory bounded by the requests of about two
/// shifts (a regional round trip either side), not by the run's length.
///
/// The reference is one ideal token bucket (rate `rate`, burst `burst`,
/// exact integer fixed-point arithmetic as in `quotalease_model::bucket`,
/// full at the first request) that sees every request, in time order (ties
/// in push order), and admits or denies each on its own, greedily. Its
/// level `L(t)` after its own decisions is known at every instant. A
/// request we denied at `t` with cost `c` is a *false* denial when the
/// ideal bucket could have paid `c` at every instant of
/// `[t - shift, t + shift]`, not counting the request's own charge:
///
/// `min over u in [t - shift, t + shift] of L'(u) >= c`, where `L'` is `L`
/// with the request's own charge (if the ideal bucket admitted it) added
/// back from `t` on, capped at the burst.
///
/// If the ideal bucket itself denied the request, the denial is not false.
/// Adding the own charge back ignores that the ideal bucket would have
/// refilled to the cap a little sooner without it, so this can count a
/// denial as false that was borderline; the other requests' decisions are
/// those of the real ideal run. A request is decided once a request later
/// than `t + shift` arrives (or at [`FalseRejectStream::finish`]); two
/// monotone deques over the request index give the window minima, O(1)
/// amortized per request.
#[derive(Clone, Debug)]
pub struct FalseRejectStream {
    p: u128,
    per_ns: u128,
    cap: u128,
    shift_ns: u64,
    /// Ideal bucket level and the time it was last brought to.
    fine: u128,
    last: Option<u64>,
    /// Requests `base..base + buf.len()` (absolute indices).
    buf: std::collections::VecDeque<Ideal>,
    base: usize,
    /// Requests pushed.
    n: usize,
    /// Next request to decide.
    k_next: usize,
    /// First request with time > t - shift (of the last decided one).
    j_next: usize,
    /// First request with time > t + shift (of the last decided one).
    end_next: usize,
    before: MinWindow,
    after: MinWindow,
    out: FalseRejects,
    /// Tokens we admitted, and tokens the ideal bucket admitted, over the
    /// same arrivals (the shortfall figure, SPEC §2).
    admitted_tokens: u64,
    ideal_tokens: u64,
    /// The per-second series, when kept (tracked keys; a cold key's are
    /// never drawn, and at 100 000 keys they were a fifth of a full-scale
    /// `zipf-100k` run's memory; boxed, so a stream without them is 40
    /// bytes smaller).
    series: Option<Box<Series>>,
}

/// A [`FalseRejectStream`]'s per-second series.
#[derive(Clone, Debug, Default)]
struct Series {
    /// Per whole second of request time: requests we denied, and of
    /// those the false ones (the report's series of false rejects over
    /// time).
    per_second: Vec<(u64, u64)>,
    /// Per whole second of request time: tokens we admitted, and tokens
    /// the ideal bucket admitted (the report's shortfall over time).
    tokens_per_second: Vec<(u64, u64)>,
}

impl FalseRejectStream {
    /// A counter for a key with `rate` and `burst`; `shift_ns` is one
    /// regional round trip.
    pub fn new(rate: Rate, burst: u64, shift_ns: u64) -> Self {
        let p = u128::from(rate.period_ns());
        Self {
            p,
            per_ns: u128::from(rate.tokens),
            cap: u128::from(burst) * p,
            shift_ns,
            fine: u128::from(burst) * p,
            last: None,
            buf: std::collections::VecDeque::new(),
            base: 0,
            n: 0,
            k_next: 0,
            j_next: 0,
            end_next: 0,
            before: MinWindow::default(),
            after: MinWindow::default(),
            out: FalseRejects::default(),
            admitted_tokens: 0,
            ideal_tokens: 0,
            series: Some(Box::default()),
        }
    }

    /// The same counter without its per-second series
    /// ([`FalseRejectStream::per_second`] and
    /// [`FalseRejectStream::tokens_per_second`] stay empty): the counts
    /// and the tokens against the ideal bucket are the same.
    pub fn without_series(mut self) -> Self {
        self.series = None;
        self
    }

    /// One request at `t` of `cost` tokens, which we `admitted` or not;
    /// `t` must not decrease from one call to the next.
    pub fn push(&mut self, t: u64, cost: u64, admitted: bool) {
        let last = self.last.unwrap_or(t);
        assert!(t >= last, "requests out of time order: {t} after {last}");
        // Every request whose window ends before `t` has all of it now.
        while self.k_next < self.n && self.at(self.k_next).t.saturating_add(self.shift_ns) < t {
            self.decide(self.k_next);
            self.k_next += 1;
        }
        self.trim(t);
        self.fine = (self.fine + u128::from(t - last) * self.per_ns).min(self.cap);
        self.last = Some(t);
        let need = u128::from(cost) * self.p;
        let charge = if need <= self.cap && self.fine >= need {
            self.fine -= need;
            need
        } else {
            0
        };
        if charge > 0 {
            self.ideal_tokens += cost;
        }
        if admitted {
            self.admitted_tokens += cost;
        }
        if let Some(series) = self.series.as_mut() {
            let s = usize::try_from(t / 1_000_000_000).unwrap_or(usize::MAX);
            if s >= series.tokens_per_second.len() {
                series.tokens_per_second.resize(s + 1, (0, 0));
            }
            let per_s = &mut series.tokens_per_second[s];
            if charge > 0 {
                per_s.1 += cost;
            }
            if admitted {
                per_s.0 += cost;
            }
        }
        if self.buf.capacity() == 0 {
            // A cold key keeps two (the last one decided and this one).
            self.buf.reserve_exact(2);
        }
        self.buf.push_back(Ideal {
            t,
            level: self.fine,
            cost,
            admitted,
            charged: charge > 0,
        });
        self.n += 1;
        self.out.requests += 1;
    }

    /// Decide the requests still open (at the end of the run: no request
    /// may be pushed after this); the counts.
    pub fn finish(&mut self) -> FalseRejects {
        while self.k_next < self.n {
            self.decide(self.k_next);
            self.k_next += 1;
        }
        self.out
    }

    /// The counts of the requests decided so far (every request pushed
    /// counts in `requests`).
    pub fn so_far(&self) -> FalseRejects {
        self.out
    }

    /// Tokens we admitted and tokens one ideal global bucket (exact,
    /// starting full) admitted over the same arrivals, so far.
    pub fn versus_ideal(&self) -> (u64, u64) {
        (self.admitted_tokens, self.ideal_tokens)
    }

    /// Per whole second of request time (second `s` covers `[s, s + 1)`
    /// s): requests we denied and of those the false ones, of the requests
    /// decided so far.
    pub fn per_second(&self) -> &[(u64, u64)] {
        self.series.as_ref().map_or(&[], |s| &s.per_second)
    }

    /// Per whole second of request time: tokens we admitted and tokens
    /// the ideal bucket admitted.
    pub fn tokens_per_second(&self) -> &[(u64, u64)] {
        self.series.as_ref().map_or(&[], |s| &s.tokens_per_second)
    }

    fn count_denial(&mut self, t: u64, false_one: bool) {
        let Some(series) = self.series.as_mut() else {
            return;
        };
        let s = usize::try_from(t / 1_000_000_000).unwrap_or(usize::MAX);
        if s >= series.per_second.len() {
            series.per_second.resize(s + 1, (0, 0));
        }
        series.per_second[s].0 += 1;
        series.per_second[s].1 += u64::from(false_one);
    }

    fn at(&self, i: usize) -> &Ideal {
        &self.buf[i - self.base]
    }

    /// Forget requests no later decision looks at: those before the last
    /// one at or before the window start of the next request to decide
    /// (the one pushed next, at `t_new`, if every one so far is decided).
    /// Moves `j_next` to that window's start now, as that decision would:
    /// windows never move backwards.
    fn trim(&mut self, t_new: u64) {
        let t_next = if self.k_next < self.n {
            self.at(self.k_next).t
        } else {
            t_new
        };
        let lo = t_next.saturating_sub(self.shift_ns);
        while self.j_next < self.n && self.at(self.j_next).t <= lo {
            self.j_next += 1;
        }
        let keep = self.j_next.saturating_sub(1).min(self.k_next);
        while self.base < keep {
            self.buf.pop_front();
            self.base += 1;
        }
    }

    fn decide(&mut self, k: usize) {
        let Ideal {
            t,
            cost,
            admitted,
            charged,
            level: level_k,
        } = *self.at(k);
        let charge = if charged {
            u128::from(cost) * self.p
        } else {
            0
        };
        let lo = t.saturating_sub(self.shift_ns);
        let hi = t.saturating_add(self.shift_ns);
        while self.j_next < self.n && self.at(self.j_next).t <= lo {
            self.j_next += 1;
        }
        while self.end_next < self.n && self.at(self.end_next).t <= hi {
            self.end_next += 1;
        }
        if admitted {
            return;
        }
        self.out.denied += 1;
        if charge == 0 {
            self.count_denial(t, false);
            return; // the ideal bucket denied it too
        }
        let (cap, per_ns) = (self.cap, self.per_ns);
        // Level at the window start: the last request at or before `lo`,
        // refilled to `lo` (full if there is none: the ideal bucket starts
        // full). A request at or after k there (only with shift 0) gets the
        // own charge back.
        let mut min = match self.j_next.checked_sub(1) {
            None => cap,
            Some(j) => {
                let e = self.at(j);
                let l = if j >= k {
                    (e.level + charge).min(cap)
                } else {
                    e.level
                };
                (l + u128::from(lo - e.t) * per_ns).min(cap)
            }
        };
        let (buf, base) = (&self.buf, self.base);
        let level = |i: usize| buf[i - base].level;
        // Requests strictly inside (lo, t) before k.
        if self.j_next < k {
            self.before.slide(level, self.j_next, k);
            min = min.min(self.before.min(level));
        }
        // The request itself, before its own decision.
        min = min.min((level_k + charge).min(cap));
        // Requests after k up to hi, with the own charge back.
        if k + 1 < self.end_next {
            self.after.slide(level, k + 1, self.end_next);
            min = min.min((self.after.min(level) + charge).min(cap));
        }
        let false_one = min >= u128::from(cost) * self.p;
        self.out.false_denied += u64::from(false_one);
        self.count_denial(t, false_one);
    }
}

/// Minimum of `values(lo..hi)` for windows whose `lo` and `hi` never move
/// backwards (monotone deque of indices). Only indices at or above the
/// current `lo` are read, so values below it may be forgotten.
#[derive(Clone, Debug, Default)]
struct MinWindow {
    deque: std::collections::VecDeque<usize>,
    hi: usize,
}

impl MinWindow {
    fn slide(&mut self, values: impl Fn(usize) -> u128, lo: usize, hi: usize) {
        // Indices below `lo` never count again; whether they were pushed
        // does not change which later ones survive.
        while self.deque.front().is_some_and(|&f| f < lo) {
            self.deque.pop_front();
        }
        self.hi = self.hi.max(lo);
        while self.hi < hi {
            let v = values(self.hi);
            while self.deque.back().is_some_and(|&b| values(b) >= v) {
                self.deque.pop_back();
            }
            self.deque.push_back(self.hi);
            self.hi += 1;
        }
    }

    fn min(&self, values: impl Fn(usize) -> u128) -> u128 {
        self.deque.front().map_or(u128::MAX, |&f| values(f))
    }
}

/// Utilization per window: tokens admitted in `[from + k*w, from + (k+1)*w)`
/// divided by `R * w`, for every whole window inside `[from_ns, to_ns)`.
/// `admissions` are `(t_ns, tokens)` in any order. SPEC §2 asks for >= 97%
/// over windows of 10 x `TTL_max` after warm-up.
pub fn utilization(
    admissions: &[(u64, u64)],
    rate: Rate,
    from_ns: u64,
    to_ns: u64,
    window_ns: u64,
) -> Vec<f64> {
    let mut u = UtilizationStream::new(from_ns, to_ns, window_ns);
    for &(t, c) in admissions {
        u.push(t, c);
    }
    u.ratios(rate)
}

/// [`utilization`] fed one admission at a time (any order): one counter
/// per whole window.
#[derive(Clone, Debug)]
pub struct UtilizationStream {
    from_ns: u64,
    window_ns: u64,
    sums: Vec<u64>,
}

impl UtilizationStream {
    /// Whole windows of `window_ns` inside `[from_ns, to_ns)`.
    pub fn new(from_ns: u64, to_ns: u64, window_ns: u64) -> Self {
        let windows = if window_ns == 0 || to_ns <= from_ns {
            0
        } else {
            ((to_ns - from_ns) / window_ns) as usize
        };
        Self {
            from_ns,
            window_ns,
            sums: vec![0; windows],
        }
    }

    /// `tokens` admitted at `t`.
    pub fn push(&mut self, t: u64, tokens: u64) {
        if t < self.from_ns || self.sums.is_empty() {
            return;
        }
        let k = ((t - self.from_ns) / self.window_ns) as usize;
        if let Some(s) = self.sums.get_mut(k) {
            *s += tokens;
        }
    }

    /// Admitted / (R * w) per window.
    pub fn ratios(&self, rate: Rate) -> Vec<f64> {
        let capacity = rate.tokens as f64 * self.window_ns as f64 / rate.period_ns() as f64;
        self.sums.iter().map(|&s| s as f64 / capacity).collect()
    }
}

/// Max-min fair (water-filling) shares of `supply` among holders with
/// these demands: holders demanding less than an equal split get their
/// demand, the rest split what is left equally. Negative or NaN demands
/// count as 0. The shares sum to `min(supply, sum of demands)`.
pub fn max_min_shares(demands: &[f64], supply: f64) -> Vec<f64> {
    let clean = |d: f64| if d.is_nan() { 0.0 } else { d.max(0.0) };
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by(|&a, &b| clean(demands[a]).total_cmp(&clean(demands[b])));
    let mut shares = vec![0.0; demands.len()];
    let mut left = supply.max(0.0);
    let mut holders = demands.len();
    for &i in &order {
        let equal = left / holders as f64;
        let s = clean(demands[i]).min(equal);
        shares[i] = s;
        left -= s;
        holders -= 1;
    }
    shares
}

/// Fairness of `actual` allocations against the max-min fair shares of
/// `supply` for `demands` ([`max_min_shares`]).
///
/// Returns Jain's index of the ratios `x_i = actual_i / fair_i` over the
/// holders whose fair share is positive: `(sum x)^2 / (n * sum x^2)`, 1
/// when every holder got the same fraction of its fair share, down to
/// `1/n` when one holder got everything. It measures how evenly the
/// shortfall (or excess) is spread, not how much was used — utilization is
/// a separate figure. 1 when no holder has a positive fair share. See
/// [`worst_fair_ratio`] for the worst-served holder.
pub fn fairness(actual: &[f64], demands: &[f64], supply: f64) -> f64 {
    let fair = max_min_shares(demands, supply);
    let (mut sum, mut sum_sq, mut n) = (0.0, 0.0, 0usize);
    for (i, &f) in fair.iter().enumerate() {
        if f > 0.0 {
            let x = actual.get(i).copied().unwrap_or(0.0).max(0.0) / f;
            sum += x;
            sum_sq += x * x;
            n += 1;
        }
    }
    if n == 0 {
        1.0
    } else if sum_sq == 0.0 {
        // Nobody got anything: equally (un)served.
        1.0
    } else {
        sum * sum / (n as f64 * sum_sq)
    }
}

/// The worst-served holder: `min over holders of min(actual / fair, 1)`
/// with the max-min fair shares of [`max_min_shares`] (holders with a zero
/// fair share are skipped; 1 if there are none).
pub fn worst_fair_ratio(actual: &[f64], demands: &[f64], supply: f64) -> f64 {
    let fair = max_min_shares(demands, supply);
    fair.iter()
        .enumerate()
        .filter(|(_, &f)| f > 0.0)
        .map(|(i, &f)| (actual.get(i).copied().unwrap_or(0.0).max(0.0) / f).min(1.0))
        .fold(1.0, f64::min)
}

/// How long checks waited for their answer (arrival to decision, on the
/// simulated clock): what a gateway's client sees of a key's opening or
/// a renewal. A histogram with 8 buckets per power of two (within 12.5 %).
#[derive(Clone, Debug, Default)]
pub struct WaitHistogram {
    counts: Vec<u64>,
    /// Checks decided.
    pub checks: u64,
    /// Of those, checks that waited (were not decided on arrival).
    pub waited: u64,
    /// The longest wait (ns).
    pub max_ns: u64,
}

impl WaitHistogram {
    fn bucket(ns: u64) -> usize {
        if ns < 8 {
            return ns as usize;
        }
        let top = 63 - ns.leading_zeros() as usize; // >= 3
        let sub = ((ns >> (top - 3)) & 7) as usize;
        (top - 2) * 8 + sub
    }

    /// The smallest wait in `bucket` (ns).
    fn floor(bucket: usize) -> u64 {
        if bucket < 8 {
            return bucket as u64;
        }
        let top = bucket / 8 + 2;
        (8 + (bucket % 8) as u64) << (top - 3)
    }

    /// One check decided after `wait_ns` (0: on arrival).
    pub fn push(&mut self, wait_ns: u64) {
        self.checks += 1;
        if wait_ns == 0 {
            return;
        }
        self.waited += 1;
        self.max_ns = self.max_ns.max(wait_ns);
        let b = Self::bucket(wait_ns);
        if self.counts.len() <= b {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += 1;
    }

    /// The `q` quantile of the waits of the checks that waited (ns, the
    /// floor of its bucket; 0 if none waited).
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.waited == 0 {
            return 0;
        }
        let rank = ((self.waited as f64 * q).ceil() as u64).clamp(1, self.waited);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::floor(b);
            }
        }
        self.max_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;
    const SEC: u64 = 1_000 * MS;

    fn per_s(n: u64) -> Rate {
        Rate {
            tokens: n,
            period_s: 1,
        }
    }

    #[test]
    fn the_shortfall_compares_with_one_ideal_bucket_over_the_same_arrivals() {
        // 20/s offered for 10 s to 10/s burst 10: the ideal bucket admits
        // 10 + 100 = 110 (within one token); we admit every other request.
        let mut q = KeyQuality::new(per_s(10), 10, MS, 0, 10 * SEC, SEC);
        for i in 0..200u64 {
            q.push(i * 50 * MS, 1, i % 2 == 0);
        }
        q.finish();
        let ideal = q.false_rejects.versus_ideal().1;
        assert!((109..=111).contains(&ideal), "ideal admitted {ideal}");
        assert!((q.versus_ideal() - 100.0 / ideal as f64).abs() < 1e-9);
        // Our decisions the ideal one's: 100 %.
        let mut q = KeyQuality::new(per_s(10), 10, MS, 0, 10 * SEC, SEC);
        let mut b = quotalease_model::bucket::TokenBucket::new_full(per_s(10), 10, 0);
        for i in 0..200u64 {
            let t = i * 50 * MS;
            q.push(t, 1, b.try_acquire(1, t).is_ok());
        }
        assert_eq!(q.versus_ideal(), 1.0);
    }

    #[test]
    fn denials_are_counted_per_second_of_request_time() {
        // 10/s burst 1, shift 1 ms: at 0 s the ideal bucket pays one and
        // denies the next at once (not false); at 2.5 s it is full again, so
        // our denial there is false.
        let reqs = [(0, 1, true), (MS / 2, 1, false), (2_500 * MS, 1, false)];
        let mut s = FalseRejectStream::new(per_s(10), 1, MS);
        for (t, c, a) in reqs {
            s.push(t, c, a);
        }
        let out = s.finish();
        assert_eq!((out.denied, out.false_denied), (2, 1));
        assert_eq!(s.per_second(), &[(1, 0), (0, 0), (1, 1)]);
    }

    #[test]
    fn no_denials_no_false_denials() {
        let reqs: Vec<_> = (0..100).map(|i| (i * MS, 1, true)).collect();
        let r = false_rejects(&reqs, per_s(10), 5, MS);
        assert_eq!(
            r,
            FalseRejects {
                denied: 0,
                false_denied: 0,
                requests: 100
            }
        );
    }

    #[test]
    fn denying_with_a_full_ideal_bucket_is_false() {
        // 1 request per second at 10/s burst 10: the ideal bucket is always
        // nearly full; every denial of ours is false.
        let reqs: Vec<_> = (0..10).map(|i| (i * S, 1, i % 2 == 0)).collect();
        let r = false_rejects(&reqs, per_s(10), 10, 100 * MS);
        assert_eq!(r.denied, 5);
        assert_eq!(r.false_denied, 5);
        assert!((r.ratio() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn denials_of_an_overloaded_key_are_not_false() {
        // 100/s offered at 10/s burst 10, we admit exactly what the ideal
        // bucket admits: no false denials.
        let rate = per_s(10);
        let mut ideal = quotalease_model::bucket::TokenBucket::new_full(rate, 10, 0);
        let reqs: Vec<_> = (0..1000u64)
            .map(|i| {
                let t = i * 10 * MS;
                (t, 1, ideal.try_acquire(1, t).is_ok())
            })
            .collect();
        let r = false_rejects(&reqs, rate, 10, 20 * MS);
        assert!(r.denied > 800);
        assert_eq!(r.false_denied, 0);
    }

    #[test]
    fn shift_window_sees_a_drain_nearby() {
        // Burst 1 at 1/s: a request at 0 (admitted by the ideal bucket,
        // emptying it), then one at 0.5 s that we deny. The ideal bucket
        // denies it too (level 0.5): not false. Our denial at 2.0 s with an
        // ideal admission at 2.05 s: false only if the window does not
        // reach 2.05 s.
        let rate = per_s(1);
        let reqs = vec![
            (0, 1, true),
            (S / 2, 1, false),
            (2 * S, 1, false),
            (2 * S + 50 * MS, 1, true),
        ];
        // Window 10 ms: at 2.0 the ideal bucket is full (1) and the next
        // event is outside: false. The ideal bucket admits the request at
        // 2.0 itself and then denies the one at 2.05.
        let r = false_rejects(&reqs, rate, 1, 10 * MS);
        assert_eq!((r.denied, r.false_denied), (2, 1));
        // Window 100 ms covers 2.05: that request is denied by the ideal
        // bucket (level 0.05 after ours), the level after it is 0.05 + our
        // own charge back = 1.05 capped at 1: still false.
        let r = false_rejects(&reqs, rate, 1, 100 * MS);
        assert_eq!((r.denied, r.false_denied), (2, 1));
        // Put an ideal admission before ours, inside the window: at 1.95
        // the bucket (full) pays it, and at 2.0 it has 0.05: the ideal
        // bucket denies ours, so not false.
        let reqs = vec![(1_950 * MS, 1, true), (2 * S, 1, false)];
        let r = false_rejects(&reqs, rate, 1, 100 * MS);
        assert_eq!((r.denied, r.false_denied), (1, 0));
    }

    #[test]
    fn own_charge_is_added_back_after_the_request() {
        // Burst 2 at 1/s, full at 1.0 s. We deny a request at 1.0 s; the
        // ideal bucket admits it (2 -> 1), then admits one at 1.01 s
        // (1 -> 0.01). Without our request's own charge the level after
        // 1.01 s is 1.01 >= 1: the denial is false. A drain before it in
        // the window, admitted first by the ideal bucket, makes it justified.
        let rate = per_s(1);
        let reqs = vec![(S, 1, false), (S + 10 * MS, 1, true)];
        let r = false_rejects(&reqs, rate, 2, 30 * MS);
        assert_eq!((r.denied, r.false_denied), (1, 1));
        let reqs = vec![
            (S - 20 * MS, 1, true),
            (S - 10 * MS, 1, true),
            (S, 1, false),
        ];
        let r = false_rejects(&reqs, rate, 2, 30 * MS);
        assert_eq!((r.denied, r.false_denied), (1, 0));
        // Same drain after ours, within the window: the ideal bucket
        // admits ours first, then only one of the two (2 -> 1 -> 0.01, then
        // 0.02: denied); with ours added back the level stays >= 1.01.
        let reqs = vec![
            (S, 1, false),
            (S + 10 * MS, 1, true),
            (S + 20 * MS, 1, true),
        ];
        let r = false_rejects(&reqs, rate, 2, 30 * MS);
        assert_eq!((r.denied, r.false_denied), (1, 1));
    }

    /// Requests further apart than two shifts: the stream keeps the last
    /// one decided and the newest, no more (a cold key's memory).
    #[test]
    fn a_sparse_stream_keeps_two_requests() {
        let mut st = FalseRejectStream::new(per_s(10), 5, 30 * MS).without_series();
        for i in 0..50 {
            st.push(i * 100 * MS, 1, i % 3 != 0);
            assert!(st.buf.len() <= 2, "{} kept after {i}", st.buf.len());
        }
        assert_eq!(st.buf.capacity(), 2);
        assert_eq!(st.finish().requests, 50);
    }

    #[test]
    fn matches_brute_force() {
        // Compare the deque version with a direct scan on random inputs.
        let mut rng = crate::rng::SimRng::new(4);
        for _ in 0..200 {
            let rate = per_s(1 + rng.below(20));
            let burst = 1 + rng.below(10);
            let shift = rng.below(300) * MS;
            let reqs: Vec<(u64, u64, bool)> = (0..rng.below(60))
                .map(|_| (rng.below(5 * S), 1 + rng.below(3), rng.chance(0.5)))
                .collect();
            assert_eq!(
                false_rejects(&reqs, rate, burst, shift),
                brute(&reqs, rate, burst, shift)
            );
        }
    }

    fn brute(reqs: &[(u64, u64, bool)], rate: Rate, burst: u64, shift: u64) -> FalseRejects {
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].0);
        let p = u128::from(rate.period_ns());
        let cap = u128::from(burst) * p;
        let n = u128::from(rate.tokens);
        let mut ev = Vec::new(); // (t, level, charge)
        let mut fine = cap;
        let mut last = order.first().map_or(0, |&i| reqs[i].0);
        for &i in &order {
            let (t, c, _) = reqs[i];
            fine = (fine + u128::from(t - last) * n).min(cap);
            last = t;
            let need = u128::from(c) * p;
            let ch = if c <= burst && fine >= need { need } else { 0 };
            fine -= ch;
            ev.push((t, fine, ch));
        }
        let mut out = FalseRejects {
            requests: reqs.len() as u64,
            ..Default::default()
        };
        for (k, &i) in order.iter().enumerate() {
            let (t, c, adm) = reqs[i];
            if adm {
                continue;
            }
            out.denied += 1;
            if ev[k].2 == 0 {
                continue;
            }
            let lo = t.saturating_sub(shift);
            let hi = t + shift;
            // Level L'(u) at every event time and at lo.
            let lvl = |idx: usize| {
                if idx >= k {
                    (ev[idx].1 + ev[k].2).min(cap)
                } else {
                    ev[idx].1
                }
            };
            let mut min = match (0..ev.len()).rev().find(|&x| ev[x].0 <= lo) {
                None => cap,
                Some(j) => (lvl(j) + u128::from(lo - ev[j].0) * n).min(cap),
            };
            for (idx, e) in ev.iter().enumerate() {
                if e.0 > lo && e.0 <= hi && idx != k {
                    min = min.min(lvl(idx));
                }
            }
            min = min.min((ev[k].1 + ev[k].2).min(cap));
            if min >= u128::from(c) * p {
                out.false_denied += 1;
            }
        }
        out
    }

    #[test]
    fn tokens_per_second_set_ours_beside_the_ideal_bucket_s() {
        // 1/s, burst 2: the ideal bucket pays the first two, not a third
        // 0.1 s later, and one more 1.1 s after that.
        let mut st = FalseRejectStream::new(per_s(1), 2, 0);
        st.push(0, 1, true);
        st.push(500_000_000, 1, true);
        st.push(600_000_000, 1, true);
        st.push(1_700_000_000, 1, false);
        assert_eq!(st.tokens_per_second(), &[(3, 2), (0, 1)]);
        assert_eq!(st.versus_ideal(), (3, 3));
    }

    /// Without its series a stream counts what it counts with them.
    #[test]
    fn a_stream_without_series_counts_the_same() {
        let mut with = FalseRejectStream::new(per_s(5), 3, 20 * MS);
        let mut without = FalseRejectStream::new(per_s(5), 3, 20 * MS).without_series();
        let mut rng = crate::rng::SimRng::new(11);
        let mut t = 0;
        for _ in 0..2_000 {
            t += rng.below(300) * MS;
            let cost = 1 + rng.below(2);
            let admitted = rng.below(3) > 0;
            with.push(t, cost, admitted);
            without.push(t, cost, admitted);
        }
        assert_eq!(with.versus_ideal(), without.versus_ideal());
        let (a, b) = (with.finish(), without.finish());
        assert!(a.denied > 100 && a.false_denied > 0, "{a:?}");
        assert_eq!(a, b);
        assert!(!with.per_second().is_empty() && !with.tokens_per_second().is_empty());
        assert!(without.per_second().is_empty() && without.tokens_per_second().is_empty());
    }

    #[test]
    fn utilization_windows() {
        let adm: Vec<(u64, u64)> = (0..300).map(|i| (i * 10 * MS, 1)).collect();
        // 100/s admitted against 100/s: 1.0 per 1 s window; 3 whole windows.
        let u = utilization(&adm, per_s(100), 0, 3 * S + S / 2, S);
        assert_eq!(u, vec![1.0, 1.0, 1.0]);
        let u = utilization(&adm, per_s(200), S, 3 * S, S);
        assert_eq!(u, vec![0.5, 0.5]);
        assert!(utilization(&adm, per_s(1), 0, S, 0).is_empty());
        let per_min = Rate {
            tokens: 60,
            period_s: 60,
        };
        let u = utilization(&adm, per_min, 0, S, S);
        assert_eq!(u, vec![100.0]);
    }

    #[test]
    fn water_filling() {
        let s = max_min_shares(&[1.0, 10.0, 3.0, 10.0], 12.0);
        assert_eq!(s, vec![1.0, 4.0, 3.0, 4.0]);
        let s = max_min_shares(&[1.0, 2.0], 10.0);
        assert_eq!(s, vec![1.0, 2.0]);
        let s = max_min_shares(&[5.0, 5.0, 5.0], 3.0);
        assert_eq!(s, vec![1.0, 1.0, 1.0]);
        assert!(max_min_shares(&[], 3.0).is_empty());
        assert_eq!(
            max_min_shares(&[-1.0, f64::NAN, 4.0], 2.0),
            vec![0.0, 0.0, 2.0]
        );
    }

    #[test]
    fn fairness_index() {
        let d = [1.0, 10.0, 3.0, 10.0];
        assert!((fairness(&[1.0, 4.0, 3.0, 4.0], &d, 12.0) - 1.0).abs() < 1e-12);
        // Everyone at half their fair share: still even.
        assert!((fairness(&[0.5, 2.0, 1.5, 2.0], &d, 12.0) - 1.0).abs() < 1e-12);
        // One holder takes everything of four: 1/4.
        let f = fairness(&[0.0, 12.0, 0.0, 0.0], &[10.0; 4], 12.0);
        assert!((f - 0.25).abs() < 1e-12, "{f}");
        assert_eq!(worst_fair_ratio(&[1.0, 4.0, 1.5, 4.0], &d, 12.0), 0.5);
        assert_eq!(worst_fair_ratio(&[], &[], 1.0), 1.0);
    }

    #[test]
    fn wait_histogram_quantiles_are_within_a_bucket() {
        let mut h = WaitHistogram::default();
        h.push(0);
        for ms in 1..=100u64 {
            h.push(ms * 1_000_000);
        }
        assert_eq!((h.checks, h.waited, h.max_ns), (101, 100, 100_000_000));
        for (q, ms) in [(0.5, 50.0), (0.99, 99.0), (1.0, 100.0)] {
            let got = h.quantile_ns(q) as f64 / 1e6;
            assert!(got <= ms && got >= ms * 0.875, "q {q}: {got} ms for {ms}");
        }
        assert_eq!(WaitHistogram::default().quantile_ns(0.99), 0);
    }
}
