"""Tests of unicache.contract: what router and replica share."""
