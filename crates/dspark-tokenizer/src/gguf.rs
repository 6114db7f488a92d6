//! Builds a tokenizer from `tokenizer.ggml.*` metadata.

use crate::{backend, Result, Tokenizer, TokenizerError};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

/// GPT-2 style pattern with single digits (Qwen2).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Same with digits grouped by up to three (Llama 3).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp token types: 3 = control, 4 = user defined; both are matched whole in text.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The tokenizer metadata of a GGUF, read once so that it can be built or inspected.
pub struct GgufTokenizerSpec {
    pub model: String,
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub scores: Vec<f32>,
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub add_bos: bool,
}

fn get<'a>(content: &'a Content, key: &str) -> Option<&'a Value> {
    content.metadata.get(key)
}

fn u32_of(content: &Content, key: &str) -> Option<u32> {
    get(content, key).and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().map(|x| x as u32)))
}

fn strings(content: &Content, key: &str) -> Result<Vec<String>> {
    let v = get(content, key).ok_or_else(|| TokenizerError::MissingKey(key.into()))?;
    v.to_vec().map_err(backend)?.iter().map(|x| x.to_string().cloned().map_err(backend)).collect()
}

impl GgufTokenizerSpec {
    pub fn read(content: &Content) -> Result<Self> {
        let model = get(content, "tokenizer.ggml.model")
            .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.model".into()))?
            .to_string()
            .map_err(backend)?
            .clone();
        let pre = get(content, "tokenizer.ggml.pre").and_then(|v| v.to_string().ok().cloned());
        let tokens = strings(content, "tokenizer.ggml.tokens")?;
        let token_types = match get(content, "tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(backend)?
                .iter()
                .map(|x| x.to_i32().map_err(backend))
                .collect::<Result<Vec<_>>>()?,
            None => vec![1; tokens.len()],
        };
        let scores = match get(content, "tokenizer.ggml.scores") {
            Some(v) => v
                .to_vec()
                .map_err(backend)?
                .iter()
                .map(|x| x.to_f32().map_err(backend))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let merges = if get(content, "tokenizer.ggml.merges").is_some() {
            strings(content, "tokenizer.ggml.merges")?
        } else {
            Vec::new()
        };
        let add_bos =
            get(content, "tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false);
        Ok(Self {
            model,
            pre,
            tokens,
            token_types,
            scores,
            merges,
            bos: u32_of(content, "tokenizer.ggml.bos_token_id"),
            eos: u32_of(content, "tokenizer.ggml.eos_token_id"),
            eot: u32_of(content, "tokenizer.ggml.eot_token_id"),
            add_bos,
        })
    }

    pub fn build(self) -> Result<Tokenizer> {
        let mut tok = match self.model.as_str() {
            "gpt2" => self.byte_level_bpe()?,
            "llama" => self.sentencepiece_bpe()?,
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer model `{other}`; dspark supports byte-level BPE (`gpt2`) and SentencePiece (`llama`)"
                )))
            }
        };
        let added = |kind: i32| -> Vec<AddedToken> {
            self.tokens
                .iter()
                .zip(&self.token_types)
                .filter(|(_, &t)| t == kind)
                .map(|(s, _)| AddedToken::from(s.clone(), kind == TOKEN_TYPE_CONTROL))
                .collect()
        };
        tok.add_special_tokens(added(TOKEN_TYPE_CONTROL)).map_err(backend)?;
        tok.add_tokens(added(TOKEN_TYPE_USER_DEFINED)).map_err(backend)?;
        let mut eos = Vec::new();
        for id in [self.eos, self.eot].into_iter().flatten() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        // Chat models end turns with their end-of-turn marker even when the GGUF names another EOS.
        for marker in ["<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"] {
            if let Some(id) = self.tokens.iter().position(|t| t == marker) {
                let id = id as u32;
                let is_special = self.token_types.get(id as usize) == Some(&TOKEN_TYPE_CONTROL);
                if is_special && !eos.contains(&id) && (marker != "<|endoftext|>" || eos.is_empty()) {
                    eos.push(id);
                }
            }
        }
        Ok(Tokenizer::from_parts(tok, self.bos, self.add_bos, eos, self.tokens.len()))
    }

    fn byte_level_bpe(&self) -> Result<HfTokenizer> {
        let vocab: tokenizers::models::bpe::Vocab =
            self.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let merges = self
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::Backend(format!("malformed merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe =
            BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(false).build().map_err(backend)?;
        let mut tok = HfTokenizer::new(bpe);
        let pre = self.pre.as_deref().unwrap_or("default");
        let pre_tok: PreTokenizerWrapper = match pre {
            "smollm" => {
                Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into()
            }
            "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_PATTERN)?,
            "llama3" | "llama-bpe" | "smaug-bpe" => split_then_bytes(LLAMA3_PATTERN)?,
            "gpt-2" | "default" => ByteLevel::new(false, true, true).into(),
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "pre-tokenizer `{other}`; supported: smollm, qwen2, llama3, gpt-2"
                )))
            }
        };
        tok.with_pre_tokenizer(Some(pre_tok));
        tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        Ok(tok)
    }

    /// SentencePiece BPE (Gemma): merges are implied by the scores, so they are rebuilt the way
    /// Hugging Face converts such models: every split of a token into two vocabulary pieces is a
    /// merge, ranked by the merged token's score.
    fn sentencepiece_bpe(&self) -> Result<HfTokenizer> {
        if self.scores.len() != self.tokens.len() {
            return Err(TokenizerError::MissingKey("tokenizer.ggml.scores".into()));
        }
        let vocab: tokenizers::models::bpe::Vocab =
            self.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let normal = |i: usize| self.token_types.get(i).copied().unwrap_or(1) == 1;
        let mut merges: Vec<(f32, u32, u32, String, String)> = Vec::new();
        for (i, piece) in self.tokens.iter().enumerate() {
            if !normal(i) || piece.chars().count() < 2 {
                continue;
            }
            for (split, _) in piece.char_indices().skip(1) {
                let (l, r) = piece.split_at(split);
                if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                    merges.push((self.scores[i], li, ri, l.to_string(), r.to_string()));
                }
            }
        }
        merges.sort_by(|a, b| {
            b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
        });
        let merges = merges.into_iter().map(|m| (m.3, m.4)).collect();
        let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
        if let Some(unk) = self.tokens.iter().position(|t| t == "<unk>") {
            builder = builder.unk_token(self.tokens[unk].clone());
        }
        let bpe = builder.fuse_unk(true).build().map_err(backend)?;
        let mut tok = HfTokenizer::new(bpe);
        let space = Replace::new(" ", "\u{2581}").map_err(backend)?;
        tok.with_normalizer(Some(NormalizerWrapper::Replace(space))).map_err(backend)?;
        // SentencePiece sees the whole text as one piece (no pre-tokenizer); decoding maps ▁ back
        // to spaces and byte tokens back to UTF-8.
        tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
            DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(backend)?),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ]))));
        Ok(tok)
    }
}

fn split_then_bytes(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
        .map_err(backend)?;
    Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()]).into())
}
