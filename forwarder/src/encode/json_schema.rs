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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use crate::encode::{EncodeError, Encoder, RegisteredSchema, SchemaError, SchemaKind};

    const DRAFT7: &str = r#"{
        "type": "object",
        "required": ["device", "temp"],
        "properties": {
          "device": {"type": "string", "maxLength": 64},
          "temp": {"type": "number"},
          "tags": {"type": "array", "items": {"type": "string"}},
          "pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
        }
    }"#;

    const DRAFT2020: &str = r##"{
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
          "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
          "reading": {"$ref": "#/$defs/reading"}
        },
        "$defs": {"reading": {"type": "object", "properties": {"temp": {"type": "number"}}}}
    }"##;

    fn compile(text: &str) -> Result<Encoder, SchemaError> {
        let schema = RegisteredSchema {
            id: 3,
            kind: SchemaKind::JsonSchema,
            text: text.to_owned(),
        };
        Encoder::compile(&schema, None)
    }

    fn encode(text: &str, json: &str) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        compile(text)
            .unwrap_or_else(|e| panic!("{e}"))
            .encode(json.as_bytes(), &mut out)
            .map(|()| out)
    }

    #[test]
    fn a_valid_value_is_carried_as_given() {
        let json = "{\"device\": \"d\",\n \"temp\": 21.370, \"extra\": true}";
        let record = encode(DRAFT7, json).unwrap();
        assert_eq!(record[..5], [0, 0, 0, 0, 3]);
        assert_eq!(&record[5..], json.as_bytes());
        let decoded: Value = serde_json::from_slice(&record[5..]).unwrap();
        assert_eq!(
            decoded,
            json!({"device": "d", "temp": 21.37, "extra": true})
        );
    }

    #[test]
    fn errors_give_the_instance_path_and_the_rule() {
        let e = encode(DRAFT7, r#"{"device": "d", "temp": "warm"}"#).unwrap_err();
        assert_eq!(e.path, "/temp");
        assert_eq!(e.reason, r#""warm" is not of type "number""#);
        let e = encode(DRAFT7, r#"{"temp": 1}"#).unwrap_err();
        assert_eq!(e.path, "");
        assert!(
            e.reason.contains("\"device\" is a required property"),
            "{e}"
        );
        let e = encode(DRAFT7, r#"{"device": "d", "temp": 1, "tags": ["a", 2]}"#).unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.reason.as_str()),
            ("/tags/1", r#"2 is not of type "string""#)
        );
        // Draft 7's tuple form of `items`.
        let e = encode(DRAFT7, r#"{"device": "d", "temp": 1, "pair": ["a", "b"]}"#).unwrap_err();
        assert_eq!(e.path, "/pair/1");
        // Nothing of a long value beyond a short excerpt.
        let long = "x".repeat(10_000);
        let e = encode(DRAFT7, &format!(r#"{{"device": "{long}", "temp": 1}}"#)).unwrap_err();
        assert_eq!(e.path, "/device");
        assert!(e.reason.len() < 100, "{e}");
        let e = encode(DRAFT7, r#"{"device": "d", "temp": 1"#).unwrap_err();
        assert!(e.reason.starts_with("not valid JSON"), "{e}");
    }

    #[test]
    fn draft_2020_12_keywords_apply() {
        assert!(encode(DRAFT2020, r#"{"pair": ["a", 1], "reading": {"temp": 1}}"#).is_ok());
        let e = encode(DRAFT2020, r#"{"pair": ["a", "b"]}"#).unwrap_err();
        assert_eq!(e.path, "/pair/1");
        let e = encode(DRAFT2020, r#"{"reading": {"temp": []}}"#).unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.reason.as_str()),
            ("/reading/temp", r#"the array is not of type "number""#)
        );
    }

    #[test]
    fn unusable_schemas_say_why() {
        assert!(matches!(
            compile("{not json"),
            Err(SchemaError::JsonSchemaText(_))
        ));
        assert!(matches!(
            compile(r#"{"type": 5}"#),
            Err(SchemaError::JsonSchemaCompile { .. })
        ));
        // Other documents are not fetched.
        assert!(matches!(
            compile(r#"{"$ref": "https://example.com/reading.json"}"#),
            Err(SchemaError::JsonSchemaCompile { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut out = Vec::new();
            let encoder = compile(DRAFT2020).map_err(|e| TestCaseError::fail(e.to_string()))?;
            match encoder.encode(&bytes, &mut out) {
                Ok(()) => prop_assert_eq!(&out[5..], &bytes[..]),
                Err(_) => prop_assert!(out.is_empty()),
            }
        }
    }
}
