//! A lease client that follows the leader (SPEC §7): the agent's and the
//! regional allocator's way to an allocator with `--etcd` replicas.
//!
//! It starts from the first contacts (`--allocator`, `--parent`) and
//! learns the rest from every reply: a reply that says `not_leader` and
//! names a leader sends the same batch there at once (a few hops at most),
//! the replica list is where the next call goes when the one in use fails.
//! A reply that says `not_leader` with no leader is returned as it is: the
//! allocator is reachable and has nothing to grant yet.
//!
//! [`ShardedClient`] keeps one such client per shard (SPEC §7
//! "Sharding"): a batch goes to the leader of the shard it names
//! (`LeaseBatch.shard`), learned from the `shard_routes` of every reply;
//! a shard not learned yet is asked through the first contacts, whose
//! replicas answer its keys `WRONG_SHARD` with the routes.

#![warn(clippy::all)]

use std::sync::Arc;

use parking_lot::Mutex;
use tonic::transport::Channel;

use crate::lease::allocator_client::AllocatorClient;
use crate::lease::{LeaseBatch, LeaseReply, ShardRoute, SlotWait, SlotWake};
use crate::MAX_MESSAGE_BYTES;

/// Makes a lazily connecting channel for a URL (settings, TLS) or says why
/// the URL cannot be used.
pub type Connect = dyn Fn(&str) -> Result<Channel, String> + Send + Sync;

/// Redirects followed for one batch before its reply is taken as it is.
const MAX_HOPS: usize = 3;
/// The wait a requester is told when the leader a replica named does not
/// answer.
const NO_LEADER_RETRY_MS: u64 = 500;
/// A "not leader" reply as the caller gets it: no leader to go to, and a
/// wait of at least [`NO_LEADER_RETRY_MS`].
fn no_leader(mut r: LeaseReply) -> LeaseReply {
    r.leader_url.clear();
    r.retry_after_ms = r.retry_after_ms.max(NO_LEADER_RETRY_MS);
    r
}

/// Learned replicas kept at most (a reply cannot make us hold more).
const MAX_REPLICAS: usize = 64;

/// See the module docs.
pub struct LeaderClient {
    connect: Arc<Connect>,
    inner: Mutex<Inner>,
}

struct Inner {
    /// First contacts, then learned replicas, each with its client.
    clients: Vec<(String, AllocatorClient<Channel>)>,
    /// Index of the one in use.
    current: usize,
}

impl std::fmt::Debug for LeaderClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.inner.lock();
        f.debug_struct("LeaderClient")
            .field("urls", &g.clients.iter().map(|c| &c.0).collect::<Vec<_>>())
            .field("current", &g.current)
            .finish()
    }
}

fn client(channel: Channel) -> AllocatorClient<Channel> {
    AllocatorClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

impl LeaderClient {
    /// Over ready-made channels for the first contacts, each named by its
    /// URL; `connect` makes the channels of URLs learned later.
    pub fn new(first: Vec<(String, Channel)>, connect: Arc<Connect>) -> Result<Self, String> {
        if first.is_empty() {
            return Err("at least one allocator URL is needed".into());
        }
        Ok(Self {
            connect,
            inner: Mutex::new(Inner {
                clients: first.into_iter().map(|(u, c)| (u, client(c))).collect(),
                current: 0,
            }),
        })
    }

    /// The URL calls go to now.
    pub fn current_url(&self) -> String {
        let g = self.inner.lock();
        g.clients[g.current].0.clone()
    }

    /// Every URL known (first contacts and learned replicas).
    pub fn urls(&self) -> Vec<String> {
        self.inner
            .lock()
            .clients
            .iter()
            .map(|c| c.0.clone())
            .collect()
    }

    fn pick(&self) -> (usize, String, AllocatorClient<Channel>) {
        let g = self.inner.lock();
        let i = g.current % g.clients.len();
        (i, g.clients[i].0.clone(), g.clients[i].1.clone())
    }

    /// Index of `url`, adding a client for it if it is new.
    fn index_of(&self, g: &mut Inner, url: &str) -> Option<usize> {
        if let Some(i) = g.clients.iter().position(|c| c.0 == url) {
            return Some(i);
        }
        if g.clients.len() >= MAX_REPLICAS {
            return None;
        }
        match (self.connect)(url) {
            Ok(ch) => {
                g.clients.push((url.to_string(), client(ch)));
                Some(g.clients.len() - 1)
            }
            Err(e) => {
                tracing::warn!(%url, error = %e, "an allocator replica's advertised URL cannot be used");
                None
            }
        }
    }

    /// Another shard's replica named `leader` as this client's leader:
    /// add it if it is new and go there next (a stale name costs one
    /// redirect).
    fn follow_hint(&self, leader: &str) {
        if leader.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        if let Some(i) = self.index_of(&mut g, leader) {
            g.current = i;
        }
    }

    fn learn(&self, reply: &LeaseReply) {
        if reply.replicas.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        for url in &reply.replicas {
            self.index_of(&mut g, url);
        }
    }

    /// After replica `failed` did not answer: send `batch` to the next one,
    /// once. Its grant is the answer; a refusal is "no leader yet" (the
    /// leader it names is likely the one that did not answer).
    async fn ask_another(&self, failed: usize, batch: &LeaseBatch) -> Option<LeaseReply> {
        let (j, mut c) = {
            let g = self.inner.lock();
            if g.clients.len() < 2 {
                return None;
            }
            let j = (failed + 1) % g.clients.len();
            (j, g.clients[j].1.clone())
        };
        let reply = c.lease(batch.clone()).await.ok()?.into_inner();
        self.learn(&reply);
        let mut g = self.inner.lock();
        if reply.not_leader {
            return Some(no_leader(reply));
        }
        // It granted: it leads now.
        g.current = j;
        Some(reply)
    }

    /// A `WaitSlots` wake-up at the replica calls go to now (no
    /// following: a replica that does not lead answers `not_here`, and
    /// the lease calls find the leader); `Err` is a one-line reason.
    pub async fn wait_slots(&self, w: SlotWait) -> Result<SlotWake, String> {
        let (_, url, mut c) = self.pick();
        c.wait_slots(w)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| format!("{url}: {}: {}", s.code(), s.message()))
    }

    /// Send `batch` to the leader as far as it is known; `Err` is a
    /// one-line reason, and the next call tries the next replica.
    pub async fn lease(&self, batch: LeaseBatch) -> Result<LeaseReply, String> {
        let mut hops = 0;
        // The last replica that redirected us, and its reply.
        let mut redirected: Option<LeaseReply> = None;
        loop {
            let (i, url, mut c) = self.pick();
            let reply = match c.lease(batch.clone()).await {
                Ok(r) => r.into_inner(),
                Err(status) => {
                    {
                        let mut g = self.inner.lock();
                        if g.current == i {
                            g.current = (i + 1) % g.clients.len();
                        }
                    }
                    if let Some(r) = redirected {
                        // A replica answered but the leader it named does
                        // not (it died and the election has not noticed
                        // yet): no leader yet, as far as we can tell.
                        tracing::debug!(leader = %url, code = ?status.code(), "the named allocator leader does not answer");
                        return Ok(no_leader(r));
                    }
                    let why = format!("{url}: {}: {}", status.code(), status.message());
                    // The one in use does not answer (dead, frozen, cut
                    // off). If another replica answers, the allocator is
                    // reachable: its answer counts (a grant from a new
                    // leader, or "no leader yet"), not an outage.
                    if hops == 0 {
                        if let Some(reply) = self.ask_another(i, &batch).await {
                            return Ok(reply);
                        }
                    }
                    return Err(why);
                }
            };
            self.learn(&reply);
            if reply.not_leader && reply.leader_url.is_empty() {
                // This replica knows no leader: the next call asks another
                // (its view may be stale, say after a freeze).
                let mut g = self.inner.lock();
                if g.current == i {
                    g.current = (i + 1) % g.clients.len();
                }
                return Ok(no_leader(reply));
            }
            if !reply.not_leader {
                return Ok(reply);
            }
            if reply.leader_url == url || hops == MAX_HOPS {
                // Replicas that name each other (their views of the
                // election differ for a moment): no leader for now.
                return Ok(no_leader(reply));
            }
            let mut g = self.inner.lock();
            let Some(j) = self.index_of(&mut g, &reply.leader_url) else {
                return Ok(no_leader(reply));
            };
            tracing::info!(from = %url, to = %reply.leader_url, "following the allocator leader");
            g.current = j;
            drop(g);
            hops += 1;
            redirected = Some(reply);
        }
    }
}

/// One [`LeaderClient`] per shard (see the module docs).
pub struct ShardedClient {
    /// The first contacts (`--allocator`): shard 0's until a reply says
    /// otherwise, and the way to any shard not learned yet.
    first: Arc<LeaderClient>,
    connect: Arc<Connect>,
    shards: Mutex<std::collections::BTreeMap<u32, Arc<LeaderClient>>>,
}

impl std::fmt::Debug for ShardedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedClient")
            .field("first", &self.first)
            .field("shards", &self.shards.lock().keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Shards learned at most (a reply cannot make us hold more).
const MAX_SHARDS: usize = 1024;

impl ShardedClient {
    /// Over the first contacts (see [`LeaderClient::new`]).
    pub fn new(first: Vec<(String, Channel)>, connect: Arc<Connect>) -> Result<Self, String> {
        Ok(Self {
            first: Arc::new(LeaderClient::new(first, connect.clone())?),
            connect,
            shards: Mutex::new(std::collections::BTreeMap::new()),
        })
    }

    /// The URL shard 0's calls go to now (the first contacts' until a
    /// route for it is learned).
    pub fn current_url(&self) -> String {
        self.client_for(0).current_url()
    }

    fn client_for(&self, shard: u32) -> Arc<LeaderClient> {
        self.shards
            .lock()
            .get(&shard)
            .cloned()
            .unwrap_or_else(|| self.first.clone())
    }

    /// A client for every shard a reply names that has none yet, starting
    /// from its leader (if named) and its replicas; a known shard's client
    /// goes to the leader named next (shards move: new replicas, new
    /// URLs). Whether a route changed a known shard's leader.
    fn learn(&self, reply: &LeaseReply) -> bool {
        if reply.shard_count <= 1 {
            return false;
        }
        let mut moved = false;
        let mut g = self.shards.lock();
        // The answering replica names its own shard's leader too.
        let own = ShardRoute {
            shard: reply.shard,
            leader_url: reply.leader_url.clone(),
            replicas: reply.replicas.clone(),
        };
        for route in reply.shard_routes.iter().chain(std::iter::once(&own)) {
            if route.shard >= reply.shard_count {
                continue;
            }
            if let Some(c) = g.get(&route.shard) {
                if !route.leader_url.is_empty() && c.current_url() != route.leader_url {
                    c.follow_hint(&route.leader_url);
                    moved = true;
                }
                continue;
            }
            if g.len() >= MAX_SHARDS {
                return moved;
            }
            let urls: Vec<&String> = std::iter::once(&route.leader_url)
                .filter(|u| !u.is_empty())
                .chain(route.replicas.iter())
                .take(MAX_REPLICAS)
                .collect();
            let mut first = Vec::new();
            for url in urls {
                if first.iter().any(|(u, _)| u == url) {
                    continue;
                }
                match (self.connect)(url) {
                    Ok(ch) => first.push((url.clone(), ch)),
                    Err(e) => {
                        tracing::warn!(%url, error = %e, "a shard replica's advertised URL cannot be used");
                    }
                }
            }
            if let Ok(c) = LeaderClient::new(first, self.connect.clone()) {
                tracing::info!(shard = route.shard, urls = ?c.urls(), "learned an allocator shard");
                g.insert(route.shard, Arc::new(c));
            }
        }
        moved
    }

    /// A `WaitSlots` wake-up at the shard `w` names (see
    /// [`LeaderClient::wait_slots`]).
    pub async fn wait_slots(&self, w: SlotWait) -> Result<SlotWake, String> {
        self.client_for(w.shard).wait_slots(w).await
    }

    /// Send `batch` to the leader of the shard it names (see
    /// [`LeaderClient::lease`]).
    ///
    /// When a learned shard does not answer, the batch goes to the first
    /// contacts too: a replica of another shard applies nothing of it
    /// (`WRONG_SHARD`) and names every shard's leader; if the shard's
    /// leader moved (new replicas, new URLs), the batch goes there, once.
    pub async fn lease(&self, batch: LeaseBatch) -> Result<LeaseReply, String> {
        let learned = self.shards.lock().get(&batch.shard).cloned();
        let Some(client) = learned else {
            let reply = self.first.lease(batch).await?;
            self.learn(&reply);
            return Ok(reply);
        };
        match client.lease(batch.clone()).await {
            Ok(reply) => {
                self.learn(&reply);
                Ok(reply)
            }
            Err(why) => {
                let moved = match self.first.lease(batch.clone()).await {
                    // The first contacts reached this shard's leader: its
                    // answer is the answer (a retry of the same batch is a
                    // duplicate there).
                    Ok(other)
                        if other.shard_count > 1
                            && other.shard == batch.shard
                            && !other.not_leader =>
                    {
                        self.learn(&other);
                        return Ok(other);
                    }
                    Ok(other) => self.learn(&other),
                    Err(_) => false,
                };
                if !moved {
                    return Err(why);
                }
                let reply = client.lease(batch).await?;
                self.learn(&reply);
                Ok(reply)
            }
        }
    }
}
