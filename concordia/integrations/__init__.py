"""Integrations with serving frameworks.  Each imports its framework only
inside its own module (`concordia.integrations.transformers` imports
transformers and peft), so `import concordia` never pulls them in."""
