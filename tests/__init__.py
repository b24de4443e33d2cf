"""Tests for the GPU Handoff integration and its tower agent."""
