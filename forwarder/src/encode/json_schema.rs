//! JSON Schema records: the payload validated against the schema and carried as given (the
//! bytes after the header are the JSON as it came). A schema without `$schema` is read as
//! draft 7, as Confluent's serializers do; `$ref`s to other documents are not fetched.

use jsonschema::{Draft, Validator};
use serde_json::Value;

use super::{EncodeError, SchemaError, excerpt, shortened};

pub(super) struct JsonSchemaEncoder {
    validator: Validator,
}

impl JsonSchemaEncoder {
    pub(super) fn compile(text: &str) -> Result<JsonSchemaEncoder, SchemaError> {
        let schema: Value = serde_json::from_str(text).map_err(SchemaError::JsonSchemaText)?;
        let mut options = jsonschema::options();
        if schema.get("$schema").is_none() {
            options = options.with_draft(Draft::Draft7);
        }
        let validator = options
            .build(&schema)
            .map_err(|e| SchemaError::JsonSchemaCompile {
                reason: shortened(&e.to_string()),
            })?;
        Ok(JsonSchemaEncoder { validator })
    }

    pub(super) fn encode(&self, json: &[u8], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let value: Value = serde_json::from_slice(json).map_err(|e| EncodeError {
            path: String::new(),
            reason: format!("not valid JSON: {e}"),
        })?;
        if let Err(e) = self.validator.validate(&value) {
            let placeholder = match e.instance().as_ref() {
                Value::String(s) => excerpt(s),
                Value::Array(_) => "the array".to_owned(),
                Value::Object(_) => "the object".to_owned(),
                scalar => scalar.to_string(),
            };
            return Err(EncodeError {
                path: e.instance_path().as_str().to_owned(),
                reason: shortened(&e.masked_with(placeholder).to_string()),
            });
        }
        out.extend_from_slice(json);
        Ok(())
    }
}
