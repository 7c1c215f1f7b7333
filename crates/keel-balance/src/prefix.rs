//! Prompts as the inference engines' caches see them: tokens, and blocks of tokens named by a
//! chain of hashes. One definition for the engine (`keel backend --llm`), the `prefix-affinity`
//! strategy, the simulator and the proxy's prompt reader, so that a block the proxy names is the
//! block the engine caches.
//!
//! - **Tokens.** A prompt's UTF-8 bytes in pieces of [`BYTES_PER_TOKEN`] (the last piece may be
//!   shorter): deterministic, needs no vocabulary, and near the usual 4 characters per token of
//!   English text. A token's id is its bytes read as a little-endian `u32`.
//! - **Chat.** A conversation is rendered as `role: content\n` per message, in order
//!   ([`PrefixHasher::push_message`]), so that two conversations with the same first messages
//!   share their first blocks, as they do behind a real chat template.
//! - **Blocks.** Every `block_tokens` tokens make a block; only full blocks are named (an engine
//!   caches full blocks only, as vLLM does). Block `i`'s name hashes its bytes seeded with block
//!   `i - 1`'s name, so a name stands for the whole prefix up to it: two prompts share their first
//!   `n` block names exactly when they share their first `n x block_tokens` tokens.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes of prompt text per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// The seed of the first block's hash (any fixed value; named so that all users agree).
const CHAIN_SEED: u64 = 0x6b65_656c_5f6b_7631; // "keel_kv1"

/// Most tokens a block may hold (vLLM allows 1 to 128 on GPUs; the bound keeps the hasher's
/// buffer small).
pub const MAX_BLOCK_TOKENS: usize = 1024;

/// Tokens in `bytes` of prompt text.
pub fn token_count(bytes: usize) -> usize {
    bytes.div_ceil(BYTES_PER_TOKEN)
}

/// The id of a token of up to [`BYTES_PER_TOKEN`] bytes (for `/tokenize` answers).
pub fn token_id(piece: &[u8]) -> u32 {
    let mut b = [0u8; BYTES_PER_TOKEN];
    b[..piece.len()].copy_from_slice(piece);
    u32::from_le_bytes(b)
}

/// The name of a block that follows the block named `previous` (`None` for the first).
pub fn chain(previous: Option<u64>, block: &[u8]) -> u64 {
    xxh3_64_with_seed(block, previous.unwrap_or(CHAIN_SEED))
}

/// Names the full blocks of a prompt fed in pieces, without copying more than one block.
///
/// ```
/// use keel_balance::prefix::PrefixHasher;
/// let mut a = PrefixHasher::new(2); // blocks of 2 tokens = 8 bytes
/// a.push(b"The quick brown fox jumps");
/// let mut b = PrefixHasher::new(2);
/// b.push(b"The quick brown cat");
/// assert_eq!(a.blocks()[..2], b.blocks()[..2]); // "The quick brown " is 16 bytes
/// assert_ne!(a.blocks().len(), 0);
/// assert_eq!(a.tokens(), 7); // 25 bytes
/// ```
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    block_bytes: usize,
    /// The bytes of the block being filled.
    partial: Vec<u8>,
    blocks: Vec<u64>,
    bytes: usize,
    max_blocks: usize,
}

impl PrefixHasher {
    /// A hasher for blocks of `block_tokens` tokens (clamped to 1..=[`MAX_BLOCK_TOKENS`]).
    pub fn new(block_tokens: usize) -> Self {
        let block_bytes = block_tokens.clamp(1, MAX_BLOCK_TOKENS) * BYTES_PER_TOKEN;
        PrefixHasher {
            block_bytes,
            partial: Vec::with_capacity(block_bytes),
            blocks: Vec::new(),
            bytes: 0,
            max_blocks: usize::MAX,
        }
    }

    /// The same hasher that names at most `n` blocks (later text is still counted in
    /// [`PrefixHasher::tokens`]): the bound on what a reader of prompts keeps per request.
    pub fn with_max_blocks(mut self, n: usize) -> Self {
        self.max_blocks = n;
        self
    }

    /// Clears the hasher for another prompt, keeping its allocations.
    pub fn reset(&mut self) {
        self.partial.clear();
        self.blocks.clear();
        self.bytes = 0;
    }

    /// Appends prompt text.
    pub fn push(&mut self, mut text: &[u8]) {
        self.bytes += text.len();
        while !text.is_empty() && self.blocks.len() < self.max_blocks {
            let room = self.block_bytes - self.partial.len();
            if self.partial.is_empty() && text.len() >= self.block_bytes {
                // A whole block straight from the input, without a copy.
                let name = chain(self.blocks.last().copied(), &text[..self.block_bytes]);
                self.blocks.push(name);
                text = &text[self.block_bytes..];
                continue;
            }
            let take = room.min(text.len());
            self.partial.extend_from_slice(&text[..take]);
            text = &text[take..];
            if self.partial.len() == self.block_bytes {
                let name = chain(self.blocks.last().copied(), &self.partial);
                self.blocks.push(name);
                self.partial.clear();
            }
        }
    }

    /// Appends one chat message as `role: content\n`.
    pub fn push_message(&mut self, role: &str, content: &str) {
        self.push(role.as_bytes());
        self.push(b": ");
        self.push(content.as_bytes());
        self.push(b"\n");
    }

    /// The names of the full blocks so far, in order.
    pub fn blocks(&self) -> &[u64] {
        &self.blocks
    }

    /// Tokens pushed so far (every byte counts, past the block bound too).
    pub fn tokens(&self) -> usize {
        token_count(self.bytes)
    }

    /// Bytes pushed so far.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(text: &[u8], block_tokens: usize) -> Vec<u64> {
        let mut h = PrefixHasher::new(block_tokens);
        h.push(text);
        h.blocks().to_vec()
    }

    #[test]
    fn pieces_and_whole_give_the_same_names() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whole = names(&text, 16);
        assert_eq!(whole.len(), 1000 / 64);
        for cut in [1, 3, 63, 64, 65, 500, 999] {
            let mut h = PrefixHasher::new(16);
            h.push(&text[..cut]);
            h.push(&text[cut..]);
            assert_eq!(h.blocks(), &whole[..], "cut at {cut}");
            assert_eq!(h.tokens(), 250);
        }
    }

    #[test]
    fn shared_prefixes_share_exactly_their_full_blocks() {
        let a = b"0123456789abcdef0123456789abcdefXXXXXXXXXXXXXXXX";
        let mut b = *a;
        b[33] = b'Y'; // differs in the third block of 16 bytes (4 tokens)
        let (na, nb) = (names(a, 4), names(&b, 4));
        assert_eq!(na.len(), 3);
        assert_eq!(na[..2], nb[..2]);
        assert_ne!(na[2], nb[2]);
        // The same bytes at another position name another block: the chain carries the prefix.
        assert_ne!(na[0], na[1]);
    }

    #[test]
    fn chat_messages_render_as_one_text() {
        let mut chat = PrefixHasher::new(2);
        chat.push_message("system", "You are terse.");
        chat.push_message("user", "Hi");
        let mut text = PrefixHasher::new(2);
        text.push(b"system: You are terse.\nuser: Hi\n");
        assert_eq!(chat.blocks(), text.blocks());
        assert_eq!(chat.tokens(), text.tokens());
    }

    #[test]
    fn the_block_bound_stops_naming_but_not_counting() {
        let mut h = PrefixHasher::new(1).with_max_blocks(3);
        h.push(&[b'a'; 100]);
        assert_eq!(h.blocks().len(), 3);
        assert_eq!(h.tokens(), 25);
        h.reset();
        assert_eq!((h.blocks().len(), h.tokens()), (0, 0));
    }

    #[test]
    fn token_ids_read_little_endian() {
        assert_eq!(token_id(b"ab"), u32::from_le_bytes([b'a', b'b', 0, 0]));
        assert_eq!(token_count(0), 0);
        assert_eq!(token_count(5), 2);
    }
}
