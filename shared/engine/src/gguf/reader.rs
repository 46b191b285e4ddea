//! A bounds-checked little-endian cursor over the GGUF header: every read names what it was
//! reading, so a truncated file reports where it ended.

use super::value::{Value, ValueType};
use crate::error::{Error, Result};

/// Most nested array depth accepted (the format allows arrays of arrays).
const MAX_DEPTH: usize = 8;

pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let len = self.bytes.len() as u64;
        let start = self.pos as u64;
        let end = start.saturating_add(n);
        if end > len {
            return Err(Error::Truncated {
                what: what(),
                start,
                end,
                len,
            });
        }
        let s = &self.bytes[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(super) fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(super) fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        let raw = self.take(n, what)?;
        String::from_utf8(raw.to_vec())
            .map_err(|_| Error::Malformed(format!("{} is not valid UTF-8", what())))
    }

    pub(super) fn value(&mut self, tag: u32, what: &dyn Fn() -> String) -> Result<Value> {
        self.value_at_depth(tag, what, 0)
    }

    fn value_at_depth(
        &mut self,
        tag: u32,
        what: &dyn Fn() -> String,
        depth: usize,
    ) -> Result<Value> {
        let ty = ValueType::from_u32(tag)
            .ok_or_else(|| Error::Malformed(format!("{} has unknown value type {tag}", what())))?;
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(Error::Malformed(format!("{} has bool byte {b}", what()))),
            },
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                if depth >= MAX_DEPTH {
                    return Err(Error::Malformed(format!(
                        "{} nests arrays too deeply",
                        what()
                    )));
                }
                let elem = self.u32(what)?;
                let count = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the remaining bytes is
                // a truncated (or corrupt) file, caught before allocating for it.
                let remaining = (self.bytes.len() - self.pos) as u64;
                if count > remaining {
                    return Err(Error::Truncated {
                        what: format!("{} ({count} array elements)", what()),
                        start: self.pos as u64,
                        end: self.pos as u64 + count,
                        len: self.bytes.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value_at_depth(elem, what, depth + 1)?);
                }
                Value::Array(items)
            }
        })
    }
}
