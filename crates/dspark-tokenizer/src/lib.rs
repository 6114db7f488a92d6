//! Tokenizers and chat templates for dspark's targets.
//!
//! candle's own GGUF tokenizer adds a prefix space and skips SmolLM2's digit splitting, so the
//! tokenizer is rebuilt here from the GGUF metadata with the `tokenizers` crate, one
//! pre-tokenizer per `tokenizer.ggml.pre` value, and checked against llama.cpp's ids.

mod chat;
mod gguf;

pub use chat::{ChatMessage, ChatTemplate};
pub use gguf::GgufTokenizerSpec;

use std::path::Path;
use tokenizers::Tokenizer as HfTokenizer;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("the GGUF has no tokenizer metadata key `{0}`; it cannot be tokenized without it")]
    MissingKey(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("tokenizer error: {0}")]
    Backend(String),
    #[error("chat template error: {0}")]
    Template(String),
    #[error("cannot read {path}: {msg}")]
    Io { path: String, msg: String },
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

fn backend<E: std::fmt::Display>(e: E) -> TokenizerError {
    TokenizerError::Backend(e.to_string())
}

/// A tokenizer together with the ids the decode loop needs.
pub struct Tokenizer {
    /// Splits special tokens out of the text (llama.cpp's `special = true`).
    with_special: HfTokenizer,
    /// Treats every character as text.
    plain: HfTokenizer,
    bos: Option<u32>,
    add_bos: bool,
    eos: Vec<u32>,
    vocab_size: usize,
    /// Control tokens by their text's first byte, longest first: how template markup is split.
    specials: std::collections::HashMap<u8, Vec<(String, u32)>>,
    /// Control tokens: their text is literal, not byte-level or SentencePiece encoded
    /// (user-defined added tokens such as Gemma's runs of `▁` are encoded like the vocabulary).
    control: std::collections::HashSet<u32>,
    /// Byte-level BPE (GPT-2 style) rather than SentencePiece: how a vocabulary entry maps to bytes.
    byte_level: bool,
}

impl Tokenizer {
    pub fn from_gguf(content: &candle_core::quantized::gguf_file::Content) -> Result<Self> {
        GgufTokenizerSpec::read(content)?.build()
    }

    /// Loads a Hugging Face `tokenizer.json`; `bos`/`eos` come from the model's config.
    pub fn from_hf_file(path: &Path, bos: Option<u32>, eos: Vec<u32>, add_bos: bool) -> Result<Self> {
        let tok = HfTokenizer::from_file(path)
            .map_err(|e| TokenizerError::Io { path: path.display().to_string(), msg: e.to_string() })?;
        let vocab_size = tok.get_vocab_size(true);
        Ok(Self::from_parts(tok, bos, add_bos, eos, vocab_size))
    }

    pub(crate) fn from_parts(
        with_special: HfTokenizer,
        bos: Option<u32>,
        add_bos: bool,
        eos: Vec<u32>,
        vocab_size: usize,
    ) -> Self {
        let mut plain = with_special.clone();
        plain.set_encode_special_tokens(true);
        let mut specials: std::collections::HashMap<u8, Vec<(String, u32)>> = Default::default();
        for (id, t) in with_special.get_added_tokens_decoder() {
            if t.special && !t.content.is_empty() {
                specials.entry(t.content.as_bytes()[0]).or_default().push((t.content, id));
            }
        }
        for v in specials.values_mut() {
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        let control = with_special
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(i, _)| i)
            .collect();
        let byte_level =
            matches!(with_special.get_decoder(), Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_)));
        Self { with_special, plain, bos, add_bos, eos, vocab_size, specials, control, byte_level }
    }

    /// Tokenizes `text` as-is. `parse_special` splits special tokens such as `<|im_start|>` out of
    /// the text. A BOS is prepended only when the model asks for one and the text lacks it.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special { &self.with_special } else { &self.plain };
        let enc = tok.encode_fast(text, false).map_err(backend)?;
        let mut ids = enc.get_ids().to_vec();
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Tokenizes a prompt made of trusted markup (`(text, true)`: special tokens parsed, as in
    /// [`Self::encode`] with `parse_special`) and untrusted text (`(text, false)`: every character
    /// is text, so a message cannot forge a turn). The text between two control tokens is
    /// tokenized as one piece whichever parts it came from, so a prompt whose untrusted parts hold
    /// no control-token text gets exactly the ids `encode(whole, true)` gives.
    pub fn encode_pieces(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut chunk = String::new();
        let flush = |chunk: &mut String, ids: &mut Vec<u32>| -> Result<()> {
            if !chunk.is_empty() {
                ids.extend_from_slice(
                    self.plain.encode_fast(chunk.as_str(), false).map_err(backend)?.get_ids(),
                );
                chunk.clear();
            }
            Ok(())
        };
        for &(text, markup) in pieces {
            if !markup {
                chunk.push_str(text);
                continue;
            }
            let mut start = 0;
            let mut i = 0;
            while i < text.len() {
                let hit = self
                    .specials
                    .get(&text.as_bytes()[i])
                    .and_then(|cands| cands.iter().find(|(s, _)| text[i..].starts_with(s.as_str())));
                match hit {
                    Some((s, id)) => {
                        chunk.push_str(&text[start..i]);
                        flush(&mut chunk, &mut ids)?;
                        ids.push(*id);
                        i += s.len();
                        start = i;
                    }
                    None => i += text[i..].chars().next().map_or(1, char::len_utf8),
                }
            }
            chunk.push_str(&text[start..]);
        }
        flush(&mut chunk, &mut ids)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// The first control token whose text occurs in `text`, if any.
    pub fn find_special(&self, text: &str) -> Option<&str> {
        text.char_indices().find_map(|(i, _)| {
            let cands = self.specials.get(&text.as_bytes()[i])?;
            cands.iter().find(|(s, _)| text[i..].starts_with(s.as_str())).map(|(s, _)| s.as_str())
        })
    }

    /// Decodes ids to text; special tokens are kept so that what the model said is visible.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.with_special.decode(ids, false).map_err(backend)
    }

    /// The text of one token as raw bytes may be an incomplete UTF-8 sequence; streaming callers
    /// should use [`StreamDecoder`] instead.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.with_special.id_to_token(id)
    }

    /// The exact bytes one token contributes to the text (OpenAI's `bytes` in logprobs): a
    /// byte-level token may hold part of a UTF-8 character, which `decode` of that token alone
    /// would turn into U+FFFD. `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.with_special.id_to_token(id)?;
        if self.control.contains(&id) {
            return Some(piece.into_bytes());
        }
        if self.byte_level {
            let table = unicode_to_byte();
            let mut out = Vec::with_capacity(piece.len());
            for c in piece.chars() {
                match table.get(&c) {
                    Some(&b) => out.push(b),
                    // Not a byte-level character: the vocabulary stores it literally.
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            return Some(out);
        }
        // SentencePiece: `<0xNN>` byte-fallback pieces, and ▁ for a space.
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
            if let (2, Ok(b)) = (hex.len(), u8::from_str_radix(hex, 16)) {
                return Some(vec![b]);
            }
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.with_special.token_to_id(token)
    }

    /// Special (control) tokens with their text, in id order.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> = self
            .with_special
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(i, t)| (i, t.content))
            .collect();
        v.sort();
        v
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The vocabulary as (token, id) pairs, used to check that a drafter shares the target's.
    pub fn vocab(&self) -> std::collections::HashMap<String, u32> {
        self.with_special.get_vocab(true)
    }
}

/// GPT-2's byte-level alphabet reversed: the printable bytes stand for themselves, the others
/// (control characters, space, 0x7F–0xA0, 0xAD) are shifted to U+0100 onwards in byte order.
fn unicode_to_byte() -> &'static std::collections::HashMap<char, u8> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<char, u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut shifted = 0u32;
        (0..=255u8)
            .map(|b| {
                let c = if printable(b) {
                    char::from(b)
                } else {
                    shifted += 1;
                    char::from_u32(255 + shifted).expect("U+0100..U+0143 are characters")
                };
                (c, b)
            })
            .collect()
    })
}

/// Turns a stream of ids into text pieces that are always whole UTF-8: byte-level tokens may
/// split a character (emoji, CJK) across tokens. Only a short window of recent ids is decoded
/// per step, so streaming stays linear in the output length.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    /// Start of the window, and end of the part already emitted.
    prefix: usize,
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self { tok, ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// Adds one id and returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        // Decoding from a token before the new ones keeps word-boundary spaces right.
        let before = self.tok.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tok.decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.is_char_boundary(before.len()) {
            return Ok(None);
        }
        let piece = now[before.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(Some(piece))
    }
}
