"""The JSON API under ``/v1`` (plus the operational endpoints): one blueprint module per resource."""
