"""fleetwise"""
